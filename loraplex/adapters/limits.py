"""How much an uploaded adapter may ask of us before we refuse it."""

from __future__ import annotations

from dataclasses import dataclass

_MiB = 1024 * 1024
_GiB = 1024 * _MiB


@dataclass(frozen=True)
class AdapterLimits:
    max_rank: int = 64
    max_archive_bytes: int = 2 * _GiB  # the archive or weights file as uploaded
    max_total_bytes: int = 2 * _GiB  # sum of uncompressed members; what a zip bomb inflates
    max_member_bytes: int = 2 * _GiB  # one uncompressed member
    max_members: int = 64  # files and folders in an archive or adapter directory
    max_config_bytes: int = 1 * _MiB  # adapter_config.json
    max_header_bytes: int = 16 * _MiB  # the JSON header of a safetensors file
    # where max_rank came from, as the refusal of a larger rank names it
    max_rank_from: str = "the max_lora_rank setting"

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if name == "max_rank_from":
                continue
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"AdapterLimits.{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_settings(cls, settings) -> AdapterLimits:
        """Limits from `loraplex.config.Settings` (max_lora_rank, max_upload_bytes, max_adapter_members)."""
        return cls(
            max_rank=settings.max_lora_rank,
            max_archive_bytes=settings.max_upload_bytes,
            max_members=settings.max_adapter_members,
        )
