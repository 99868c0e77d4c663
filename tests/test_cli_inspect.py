"""`edgeroute inspect`: what it says of a bundle's models."""

from __future__ import annotations


def test_inspect_names_the_blocks_carried_over_instead_of_the_method_that_did_not_run():
    from edgeroute.cli import _quantization

    dual = {"method": "int4-gptq", "head": "int8", "carried_over": True,
            "formats": {"embedding: int8/b32 (gguf:Q5_0)": 1, "int8/b32 (gguf:Q5_0)": 132,
                        "int4/b32+offset (gguf:Q4_K)": 12, "lm_head: int8/b32 (gguf:Q8_0)": 1}}
    assert _quantization(dual) == "Q4_K (12), Q5_0 (133), Q8_0 (1) carried over from the source; head int8"
    native = {"method": "int4-gptq", "head": "Q6_K", "carried_over": True, "formats": {"Q4_K": 168, "F32": 57, "Q6_K": 29}}
    assert _quantization(native) == "Q4_K (168), Q6_K (29) carried over from the source; head Q6_K"
    assert _quantization({"method": "int4-rtn", "head": "int8", "carried_over": False}) == "int4-rtn, head int8"
