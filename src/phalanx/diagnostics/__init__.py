"""Diagnostics: what each machine is (`phalanx env`), and whether the machines of one job fit
together (`phalanx doctor`). Importing this package does not import torch."""
