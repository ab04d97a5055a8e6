"""qfuse.export.format: metadata encoding, version gate, checksums, module registry."""

import doctest
import json

import pytest
import torch

import qfuse
import qfuse.export.format as fmt
from qfuse.nn import QConv2d, QLinear
from qfuse.state import LayerRecord


def _meta(**changes):
    meta = {
        "format": fmt.FORMAT_NAME,
        "format_version": fmt.FORMAT_VERSION,
        "qfuse_version": "0.1.0",
        "config": qfuse.QConfig.int8_static().to_dict(),
        "chains": [],
        "layers": [],
        "checksums": {},
    }
    meta.update(changes)
    return fmt.encode(meta)


def test_encode_decode_round_trip():
    meta = fmt.decode(_meta(), "f")
    assert meta["format_version"] == fmt.FORMAT_VERSION
    assert meta["aliases"] == {} and meta["skipped"] == []  # optional fields default


@pytest.mark.parametrize(
    "raw, message",
    [
        (None, "without qfuse metadata"),
        ({"format": "pt"}, "without qfuse metadata"),
        ({fmt.METADATA_KEY: "{not json"}, "not valid JSON"),
        ({fmt.METADATA_KEY: json.dumps({"format": "other"})}, "does not describe a qfuse file"),
        (_meta(format_version="1"), "not a valid version"),
        (_meta(format_version=0), "not a valid version"),
        (_meta(format_version=fmt.FORMAT_VERSION + 1), "newer than this qfuse reads.*Upgrade"),
    ],
)
def test_decode_rejects_what_it_cannot_read(raw, message):
    with pytest.raises(qfuse.FormatError, match=message):
        fmt.decode(raw, "model.safetensors")


def test_decode_names_missing_fields():
    meta = json.loads(_meta()[fmt.METADATA_KEY])
    del meta["checksums"], meta["layers"]
    with pytest.raises(qfuse.FormatError, match=r"lacks \['layers', 'checksums'\]"):
        fmt.decode(fmt.encode(meta), "f")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor(3.5),
        torch.arange(12, dtype=torch.int8).reshape(3, 4),
        torch.randn(5, 3).to(torch.bfloat16),
        torch.randn(4, 4).t(),  # not contiguous: hashed as stored (contiguous)
        torch.empty(0, 3),
    ],
)
def test_checksum_sees_every_byte(tensor):
    before = fmt.checksum(tensor)
    assert before == fmt.checksum(tensor.clone().contiguous())
    if tensor.numel():
        flipped = tensor.clone().contiguous()
        flipped.reshape(-1).view(torch.uint8)[0] ^= 1
        assert fmt.checksum(flipped) != before


def test_quantized_module_types_include_the_runtime_modules():
    types = fmt.quantized_module_types()
    assert types["QLinear"] is QLinear and types["QConv2d"] is QConv2d


def test_layer_entry_round_trips_the_record():
    record = LayerRecord("enc.fc", "Linear→GELU", "linear", "int8", "float", "int8 to enc.out")
    module = QLinear.from_float(torch.randn(4, 3), None, x_scale=0.1, x_zero_point=None)
    entry = fmt.layer_entry(record, "enc.fc", module, "torch reference (cpu)")
    entry = json.loads(json.dumps(entry))  # what the file stores
    assert fmt.layer_record(entry) == record
    assert entry["module"] == "QLinear" and entry["layout"] == module.layout()


def test_docstring_examples():
    assert doctest.testmod(fmt).failed == 0


def test_decode_names_a_layer_entry_that_lacks_fields():
    raw = _meta(layers=[{"name": "enc.fc", "chain": "enc.fc", "module": "QLinear", "layout": {}}])
    with pytest.raises(qfuse.FormatError, match=r"enc.fc lacks \['pattern', 'layout.buffers'\]"):
        fmt.decode(raw, "f")


def test_config_from_a_newer_qfuse_is_a_format_error():
    meta = fmt.decode(_meta(), "f")
    meta["config"]["version"] = 99
    with pytest.raises(qfuse.FormatError, match="QConfig cannot be read.*upgrade qfuse"):
        fmt.config_of(meta, "f")


def test_skipped_list_round_trips_and_rejects_malformed_entries():
    meta = fmt.decode(_meta(skipped=[{"name": "lm_head", "kind": "linear", "reason": "tied"}]), "f")
    assert [(s.name, s.reason) for s in fmt.skipped_of(meta, "f")] == [("lm_head", "tied")]
    meta["skipped"] = [{"name": "lm_head"}]
    with pytest.raises(qfuse.FormatError, match="skipped-layer list is malformed"):
        fmt.skipped_of(meta, "f")
