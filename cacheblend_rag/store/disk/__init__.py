"""The local-disk tier: the store itself (`tier`), the folder it claims (`folder`), the index it distrusts
(`index`), the value files it reads and writes (`files`) and the pause it takes when the disk is full (`pause`)."""

from .tier import DiskStore, check_disk_dir

__all__ = ["DiskStore", "check_disk_dir"]
