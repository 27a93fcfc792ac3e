"""What a user configures, and how it is read: the options (:mod:`.options`, every default once), the schema
machinery, the combination table (:mod:`.rules`) and what the axes share (:mod:`.axis`), config files and
Accelerate's (:mod:`.files`, :mod:`.accelerate`), dtype names. :mod:`.resolve` combines them into one
:class:`~fp8dist.config.resolve.Config`."""
