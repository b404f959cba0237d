"""Activations vs parameters: measured activations and training-memory peaks of causal LMs.

One module per stage; the data flows one way:
registry -> configs -> activations / memory -> fit -> estimate / validate -> dataset / figures.
"""

__version__ = "0.1.0"
