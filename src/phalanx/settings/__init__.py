"""Launch settings, below every other package: the option table (flags, ``PHALANX_<FLAG>`` and
``PET_<FLAG>`` variables, config-file keys), the values' parsers, the config file, the one
resolver every command uses, and what every worker runs."""
