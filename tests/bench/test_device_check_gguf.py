"""scripts/device_check.py's GGUF regeneration on the device, which reaches no network: the preset written again from
the artifact's tokenizer keys is the build machine's file to the byte (its sha is what the device checks), for a
padded vocabulary and for gpt-oss's harmony tokens on the padding rows."""

from __future__ import annotations

import json

import pytest
from luce_runtime.artifact import file_sha256

from luce_compile.gguf.reader import read_gguf
from tests.bench._load import load_script

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gptoss"])
def test_regenerated_gguf_is_the_build_machines(tmp_path, name, monkeypatch):
    import luce_compile.synthetic as synthetic

    check = load_script("device_check")
    built = synthetic.cached_synthetic(name)
    source = read_gguf(built)
    try:
        keys = {k: v for k, v in source.metadata.items() if k.startswith("tokenizer.")}
    finally:
        source.close()
    folder = tmp_path / "folder"
    (folder / "artifact").mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps({"preset": name}))
    (folder / "artifact" / "tokenizer.json").write_text(json.dumps(keys))
    monkeypatch.setattr(synthetic, "tokenizer_metadata", synthetic.tokenizer_metadata)  # generate_gguf replaces it
    check.generate_gguf(folder, tmp_path / "again.gguf")
    assert file_sha256(tmp_path / "again.gguf") == file_sha256(built)
