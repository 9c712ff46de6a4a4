"""The ``phalanx`` command line: thin parsers over the library (:mod:`phalanx.launch`)."""
