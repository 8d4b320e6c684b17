"""The one error the adapters package raises for a bad adapter, with a machine-readable code."""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why an adapter was refused. Values are stable: the control plane stores them with a failed upload."""

    NOT_FOUND = "not_found"
    UNSUPPORTED_FORMAT = "unsupported_format"
    PICKLE_FILE = "pickle_file"
    ARCHIVE_CORRUPT = "archive_corrupt"
    ARCHIVE_UNSAFE_PATH = "archive_unsafe_path"
    ARCHIVE_LINK = "archive_link"
    ARCHIVE_SPECIAL_FILE = "archive_special_file"
    ARCHIVE_TOO_MANY_MEMBERS = "archive_too_many_members"
    ARCHIVE_MEMBER_TOO_LARGE = "archive_member_too_large"
    ARCHIVE_TOO_LARGE = "archive_too_large"
    MISSING_CONFIG = "missing_config"
    MISSING_WEIGHTS = "missing_weights"
    AMBIGUOUS_ADAPTER = "ambiguous_adapter"
    CONFIG_INVALID = "config_invalid"
    PEFT_TYPE = "peft_type"
    TASK_TYPE = "task_type"
    DORA_UNSUPPORTED = "dora_unsupported"
    MODULES_TO_SAVE_UNSUPPORTED = "modules_to_save_unsupported"
    BIAS_UNSUPPORTED = "bias_unsupported"
    EMBEDDING_LORA_UNSUPPORTED = "embedding_lora_unsupported"
    OPTION_UNSUPPORTED = "option_unsupported"
    UNKNOWN_TARGET_MODULE = "unknown_target_module"
    INVALID_RANK = "invalid_rank"
    RANK_TOO_LARGE = "rank_too_large"
    INVALID_ALPHA = "invalid_alpha"
    LAYER_OUT_OF_RANGE = "layer_out_of_range"
    HEADER_TOO_LARGE = "safetensors_header_too_large"
    SAFETENSORS_CORRUPT = "safetensors_corrupt"
    DTYPE_UNSUPPORTED = "dtype_unsupported"
    UNKNOWN_TENSOR = "unknown_tensor"
    MISSING_TENSOR = "missing_tensor"
    SHAPE_MISMATCH = "shape_mismatch"
    RANK_MISMATCH = "rank_mismatch"
    NON_FINITE = "non_finite"
    ARCHITECTURE_UNSUPPORTED = "architecture_unsupported"
    BASE_MODEL_MISMATCH = "base_model_mismatch"
    STORE_CORRUPT = "store_corrupt"
    UNREADABLE = "unreadable"  # none of the above: a file no specific check foresaw


class AdapterValidationError(ValueError):
    """An adapter was refused. `str(err)` names the problem (file, tensor, module, value); `code` says
    which kind of problem it is, for callers that branch on it or store it."""

    def __init__(self, message: str, code: ErrorCode | str):
        super().__init__(message)
        self.message = message
        self.code = ErrorCode(code)

    def __reduce__(self):
        # Celery pickles exceptions between worker and caller; keep both arguments across the trip.
        return (type(self), (self.message, self.code.value))
