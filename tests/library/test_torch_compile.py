"""The shared compile settings: the inductor workaround only where the torch version needs it, the recompile
limit the compiled paths raise, and flex attention as a compiled layer calls it: traced into the layer's graph
without a break (a break would leave flex to run eagerly, computing every score), equal to torch's own."""

import pytest


@pytest.mark.parametrize("version, needed", [("2.11.0", True), ("2.11.0+cu130", True), ("2.11.2+cpu", True),
                                             ("2.10.1", False), ("2.12.0", False), ("2.13.0+cpu", False),
                                             ("3.11.0", False), ("nightly", False)])
def test_inductor_workaround_only_where_the_torch_version_needs_it(version, needed):
    from dflash_assets.torch_compile import apply_inductor_workarounds, needs_coalesce_tiling_workaround

    assert needs_coalesce_tiling_workaround(version) is needed
    import torch._inductor.config as inductor_config

    before = inductor_config.triton.coalesce_tiling_analysis
    try:
        inductor_config.triton.coalesce_tiling_analysis = True
        applied = apply_inductor_workarounds(version)
        assert applied == ({"triton.coalesce_tiling_analysis": False} if needed else {})
        assert inductor_config.triton.coalesce_tiling_analysis is (not needed)
    finally:
        inductor_config.triton.coalesce_tiling_analysis = before


def test_allow_recompiles_raises_the_limit_and_never_lowers_it():
    import torch

    from dflash_assets.torch_compile import allow_recompiles

    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    before = getattr(cfg, name)
    try:
        setattr(cfg, name, 8)
        allow_recompiles(64)
        assert getattr(cfg, name) == 64
        allow_recompiles(16)
        assert getattr(cfg, name) == 64
    finally:
        setattr(cfg, name, before)


def test_flex_attention_traces_into_a_compiled_layer_without_a_break():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    from dflash_assets.torch_compile import flex_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 128, 16, generator=gen)
    k, v = torch.randn(1, 2, 128, 16, generator=gen), torch.randn(1, 2, 128, 16, generator=gen)
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 128, 128, device="cpu")

    def layer(q, k, v, mask):
        return flex_attention(q, k, v, mask, scale=0.5) * 2

    explained = torch._dynamo.explain(layer)(q, k, v, mask)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch.testing.assert_close(layer(q, k, v, mask),
                               torch_flex(q, k, v, block_mask=mask, scale=0.5, enable_gqa=True) * 2)


def test_flex_kernel_options_reach_every_later_flex_call_until_cleared(monkeypatch):
    """set_flex_kernel_options: later calls pass them as kernel_options (traced or eager), returning the ones
    before; None clears them, and a call then passes none (flex's own tiles)."""
    import torch
    import torch.nn.attention.flex_attention as flex_module
    from torch.nn.attention.flex_attention import create_block_mask

    from dflash_assets.torch_compile import flex_attention, set_flex_kernel_options

    seen = []
    real = flex_module.flex_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("kernel_options"))
        return real(*args, **kwargs)

    monkeypatch.setattr(flex_module, "flex_attention", spy)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 128, 16, generator=gen) for h in (4, 2, 2))
    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 128, 128, device="cpu")
    plain = flex_attention(q, k, v, mask)
    tiles = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    assert set_flex_kernel_options(tiles) == {}
    try:
        torch.testing.assert_close(flex_attention(q, k, v, mask), plain)  # tiles change no result
        tiles["BLOCK_M"] = 32  # the caller's dict is copied, not kept
        flex_attention(q, k, v, mask)
    finally:
        assert set_flex_kernel_options(None) == {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
    flex_attention(q, k, v, mask)
    assert seen == [None, {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2},
                    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}, None]


def test_flex_kernel_options_block_restores_the_options_before():
    from dflash_assets.torch_compile import current_flex_kernel_options, flex_kernel_options, set_flex_kernel_options

    set_flex_kernel_options({"BLOCK_M": 32})
    try:
        with flex_kernel_options({"num_warps": 8}) as inside:
            assert inside == current_flex_kernel_options() == {"num_warps": 8}
        assert current_flex_kernel_options() == {"BLOCK_M": 32}
        try:
            with flex_kernel_options(None):
                assert current_flex_kernel_options() == {}
                raise RuntimeError("a failing step")
        except RuntimeError:
            pass
        assert current_flex_kernel_options() == {"BLOCK_M": 32}  # restored on an error too
    finally:
        set_flex_kernel_options(None)


def test_drafter_flex_tiles_only_where_measured(monkeypatch):
    """An H100-class GPU (sm90) at head dim 64 gets the measured tiles; another capability, head size or a CPU
    gets none (flex's own). The capability is what torch reports for the device."""
    import torch

    from dflash_assets.torch_compile import DRAFTER_FLEX_TILES, drafter_flex_kernel_options

    assert drafter_flex_kernel_options("cpu", 64) == {}
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    tiles = drafter_flex_kernel_options("cuda:0", 64)
    assert tiles == DRAFTER_FLEX_TILES[((9, 0), 64)] and tiles["num_warps"] == 8
    tiles["num_warps"] = 4  # a copy: the table is not changed through it
    assert DRAFTER_FLEX_TILES[((9, 0), 64)]["num_warps"] == 8
    assert drafter_flex_kernel_options(torch.device("cuda", 0), 128) == {}
    capability["value"] = (8, 0)
    assert drafter_flex_kernel_options("cuda", 64) == {}
