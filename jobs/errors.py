"""Errors of the job layer."""


class ManifestError(ValueError):
    """A manifest, policy or job folder is malformed; the message names file, line and
    problem (and, for a damaged job folder, what to do)."""
