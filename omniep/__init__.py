"""omniep: hardware-portable expert-parallel dispatch/combine."""
__version__ = "0.1.0"
