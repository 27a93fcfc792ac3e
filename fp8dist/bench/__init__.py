"""The benchmark behind ``fp8dist bench``: ``runner`` plans the strategy x FP8 x size matrix and launches each cell
in fresh processes, ``cell`` trains one cell and measures it, ``comm`` counts the bytes of every collective,
``results`` writes the JSON and the markdown table, ``plot`` the PNG."""
