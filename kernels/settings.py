"""The environment variables the kernels read, in one place.

Nothing else in ``kernels/`` reads ``os.environ``; each reader builds a :class:`KernelSettings` at
the moment its value matters, which differs per setting:

* ``LOOM_FORCE_TRITON`` at import of :mod:`kernels.dispatch` (:func:`kernels.force_triton` changes
  it afterwards, in process);
* ``LOOM_CPU_KERNELS`` (and torch's ``TORCH_EXTENSIONS_DIR``) on the first call of
  :func:`kernels.cpu_kernels.cpu_kernels`;
* ``TRITON_INTERPRET`` at import of :mod:`kernels.triton_common`, which is when the ``@triton.jit``
  decorations next to it decide between compiled and interpreted kernels.

No instance is cached here on purpose: ``import kernels`` happens before some callers set
``TRITON_INTERPRET`` (the benchmark's ``--dry-run``, the test conftest), so one snapshot taken at
package import would be wrong for the later readers.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# Loom's own switches: these spellings turn a switch off, anything else turns it on (as before the
# settings class existed, plus case-insensitivity and "no"/"off").
_LOOM_OFF = frozenset({"", "0", "false", "no", "off"})
# Triton's own parser (getenv_bool in libtriton): only these, in any case, mean on. Mirrored rather
# than imported so that reading the settings never imports Triton.
_TRITON_ON = frozenset({"1", "true", "on", "yes", "y"})


def _loom_switch(value: object) -> object:
    return value.strip().lower() not in _LOOM_OFF if isinstance(value, str) else value


def _triton_switch(value: object) -> object:
    return value.lower() in _TRITON_ON if isinstance(value, str) else value


LoomSwitch = Annotated[bool, BeforeValidator(_loom_switch)]
TritonSwitch = Annotated[bool, BeforeValidator(_triton_switch)]


class KernelSettings(BaseSettings):
    """Kernel switches from the environment (or constructor arguments, by field name or variable)."""

    model_config = SettingsConfigDict(extra="ignore", populate_by_name=True, frozen=True)

    force_triton: LoomSwitch = Field(
        False,
        validation_alias="LOOM_FORCE_TRITON",
        description="run the Triton kernels on CPU tensors too (through the interpreter)",
    )
    cpu_kernels: LoomSwitch = Field(
        True,
        validation_alias="LOOM_CPU_KERNELS",
        description="use the compiled CPU decode-attention kernel when it builds",
    )
    torch_extensions_dir: str | None = Field(
        None,
        validation_alias="TORCH_EXTENSIONS_DIR",
        description="torch's own: where it builds extensions; set, the CPU kernels are built there",
    )
    triton_interpret: TritonSwitch = Field(
        False,
        validation_alias="TRITON_INTERPRET",
        description="Triton's own switch: kernels run under its interpreter (CPU tests, dry runs)",
    )
