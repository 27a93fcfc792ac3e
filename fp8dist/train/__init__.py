"""The reference training job behind ``fp8dist train``: its config, data, models, metrics and log."""
