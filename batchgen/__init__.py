"""batchgen: offline batch generation for LLMs."""
__version__ = "0.1.0"
