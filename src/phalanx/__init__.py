"""phalanx: multi-node synchronous data-parallel training with PyTorch that starts the first time.

Importing this package is cheap: it loads neither torch nor torch.distributed.run. The launcher
(`phalanx run`) lives in :mod:`phalanx.launch`; the command line in :mod:`phalanx.cli`.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
