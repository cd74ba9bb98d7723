"""Images: what a sandbox's root file system is made of, resolved to read-only directories.

A reference names an image; :class:`ImageResolver` turns it into the directories a runtime
stacks as lower layers (see :mod:`orchard.env.images.resolver` for the schemes).
"""

from orchard.env.images.reference import ImageReference, parse_image_reference
from orchard.env.images.resolver import ImageResolver, ResolvedImage
from orchard.env.images.trust import ImageNotAllowed, ImageTrust

__all__ = [
    "ImageNotAllowed",
    "ImageReference",
    "ImageResolver",
    "ImageTrust",
    "ResolvedImage",
    "parse_image_reference",
]
