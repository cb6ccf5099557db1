"""hf_csv.core.errors: every hf_csv exception is a CSVError and also the built-in error callers already catch."""
import inspect

import pytest

import hf_csv
import hf_csv.core.errors as errors


def test_every_error_is_a_csv_error_and_exported():
    classes = [c for n, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__]
    assert {c.__name__ for c in classes} == {"CSVError", "FingerprintMismatchError", "IndexFormatError",
                                            "UnsupportedVersionError"}
    for c in classes:
        assert issubclass(c, errors.CSVError) and issubclass(c, Exception), c
        assert getattr(hf_csv, c.__name__) is c  # the package exports the same classes


@pytest.mark.parametrize("cls, builtin", [(errors.FingerprintMismatchError, ValueError),
                                          (errors.IndexFormatError, ValueError),
                                          (errors.UnsupportedVersionError, RuntimeError)])
def test_each_error_is_caught_as_its_builtin_and_as_csv_error(cls, builtin):
    for catch in (builtin, errors.CSVError):
        with pytest.raises(catch, match="why"):
            raise cls("why")
    assert not issubclass(errors.CSVError, (ValueError, RuntimeError))  # the base alone is neither
