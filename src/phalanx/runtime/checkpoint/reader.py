"""DCP's file reader, with a metadata file that cannot run code when it is read.

:class:`SafeReader` unpickles ``.metadata`` with an allowlist of what DCP writes there for
phalanx's checkpoints, in place of torch's plain ``pickle.load`` (docs/runtime-design.md).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from phalanx.runtime.checkpoint.folder import DCP_METADATA

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "StorageMeta",
        "MetadataIndex", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if name == "BytesStorageMetadata":
            raise pickle.UnpicklingError("it lists a pickled value, which loading would unpickle, and phalanx stores "
                                         "tensors only")  # fmt: skip
        raise pickle.UnpicklingError(f"{module}.{name} is not something DCP writes in a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """A FileSystemReader whose metadata is read with an allowlist (see the module)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata. Raises pickle.UnpicklingError on anything not allowed."""
        with (Path(self.path) / DCP_METADATA).open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"the metadata is a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
