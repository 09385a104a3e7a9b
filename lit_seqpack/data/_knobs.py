"""Private alias of the old path: the DataModule's setting checks moved to :mod:`lit_seqpack.data._settings`."""

from lit_seqpack._checks import check_flag
from lit_seqpack.data._settings import check_batching_settings as check_knobs
from lit_seqpack.data._settings import check_parallel_settings as check_parallel_knobs
from lit_seqpack.data._settings import check_setting_types

__all__ = ["check_flag", "check_knobs", "check_parallel_knobs", "check_setting_types"]
