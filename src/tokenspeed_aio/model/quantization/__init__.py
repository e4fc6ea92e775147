"""FP8 linear layers: the checkpoint formats (config.py) and the layers' FP8 weights."""
