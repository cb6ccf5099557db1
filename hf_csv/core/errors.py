"""Exceptions raised by hf_csv (all subclass :class:`CSVError`)."""


class CSVError(Exception):
    """Base class of hf_csv errors."""


class FingerprintMismatchError(CSVError, ValueError):
    """An index was used with a head it was not built for."""


class IndexFormatError(CSVError, ValueError):
    """An index artifact is missing, corrupt, truncated or of an unknown format."""


class UnsupportedVersionError(CSVError, RuntimeError):
    """The installed transformers version is not one hf_csv was tested with."""
