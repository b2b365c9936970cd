"""The lower tiers of the prefix cache (host, disk; one protocol: ``base.LowerTier``).

``base``: the protocol, the step's copies, the tier names. ``host``: ``HostTier``. ``disk``:
``DiskTier`` (I/O worker, read-ahead) over ``disk_store.DiskStore`` (block files, ``disk_files``:
their format and checks). ``stack``: ``TierStack``, the manager's list of them. ``costs``:
``TierCosts``, reload or recompute. Import the classes from their modules; this package exports
only the light names of ``base`` (the memory core's low modules read them).
"""

from pagedkv.memory.tiers.base import DEVICE, DISK, HOST, LowerTier, StepCopies, TierCopies

__all__ = ["DEVICE", "DISK", "HOST", "LowerTier", "StepCopies", "TierCopies"]
