"""The lab's error (its own module, so that ``netns`` and ``slowness``, which use each other,
both import it from here and neither imports the other at load time)."""

from __future__ import annotations

from ..errors import FtmeshError


class LabError(FtmeshError):
    """The virtual lab cannot be built or driven (not root, iproute2 missing, a command failed)."""
