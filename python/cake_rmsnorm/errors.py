"""The project's error hierarchy: every error we raise derives from CakeError.

Each class also derives from the builtin a caller would expect (ValueError for bad data,
RuntimeError for environment faults), so `except ValueError` keeps working for users.
"""


class CakeError(Exception):
    """Base of every cake-rmsnorm error."""


class RegistryError(CakeError, ValueError):
    """The registry data is inconsistent (gap, overlap, unknown program, bad field)."""


class RouteError(CakeError, LookupError):
    """A query names a point the registry has no route for (unknown arch, width, T < 1...)."""


class BuildError(CakeError, RuntimeError):
    """The build failed (compiler error, bad declaration, interrupted step)."""


class ToolchainError(BuildError):
    """nvcc, cmake or ninja missing, or too old for a requested arch (preflight)."""


class PackagingError(CakeError, RuntimeError):
    """A wheel could not be written or its inputs are incomplete."""


class VerifyError(CakeError, RuntimeError):
    """A built tree or wheel failed verification; `problems` lists what is wrong."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("verification failed:\n" + "\n".join(f"  - {p}" for p in self.problems))


class ProviderError(CakeError, RuntimeError):
    """No usable provider wheel for this GPU (missing, wrong version, corrupted, unsupported arch)."""


class LaunchError(CakeError, RuntimeError):
    """A library call returned a CUDA error."""
