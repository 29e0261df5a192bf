"""Memory budgets per backend (dtrain.memory) and the plan ``engine.kind: auto`` picks from them;
Metal's wired limit around a run. MLX is stubbed: ``mx.device_info`` returns dictionaries shaped
as MLX 0.32 builds them (``mlx/backend/metal/device_info.cpp``, ``mlx/backend/cuda/device_info.cpp``).

The Metal figures follow macOS's default ``recommendedMaxWorkingSetSize``: 2/3 of RAM up to
32 GB, 3/4 above (llama.cpp logs: 10922.67 MiB on 16 GB, 21845.34 MiB on 32 GB, 73728 MiB on
96 GB Macs); ``max_buffer_length`` about half of RAM. No Mac ran these tests' numbers.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.llama import ModelArgs

from conftest import make_tiny_model
from dtrain import memory
from dtrain.errors import UserError
from dtrain.engine.plan import AUTO_HEAD_CHUNK, ESTIMATE_MARGIN, Plan, choose, estimate_step_bytes

GIB = 1024**3


def metal_info(gb: int, working_set: int, arch: str, name: str) -> dict:
    return {"device_name": name, "architecture": arch, "max_buffer_length": gb * GIB // 2,
            "max_recommended_working_set_size": working_set, "memory_size": gb * GIB, "resource_limit": 499000}


MACS = {  # RAM in GB -> mx.device_info() on Metal
    16: metal_info(16, 11453251584, "applegpu_g13g", "Apple M1"),
    24: metal_info(24, 17179869184, "applegpu_g14g", "Apple M2"),
    64: metal_info(64, 51539607552, "applegpu_g14s", "Apple M2 Max"),
    128: metal_info(128, 103079215104, "applegpu_g15s", "Apple M3 Max"),
}
H200 = {"device_name": "NVIDIA H200", "architecture": "sm_90", "uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "pci_bus_id": "0000:19:00.0", "compute_capability_major": 9, "compute_capability_minor": 0,
        "free_memory": 150_000_000_000, "total_memory": 150_754_820_096}
CPU = {"device_name": "AMD EPYC", "architecture": "x86_64"}


def stub_device(monkeypatch, kind: str, info: dict, active: int = 0, wired: list | None = None):
    """Make MLX report ``info`` for a default device on ``kind`` (metal | cuda | cpu)."""
    monkeypatch.setattr(mx, "device_info", lambda *_: dict(info))
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu if kind == "cpu" else mx.gpu))
    monkeypatch.setattr(mx.metal, "is_available", lambda: kind == "metal")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: kind == "cuda")
    monkeypatch.setattr(mx, "get_active_memory", lambda: active)
    if wired is not None:  # records each limit set; returns the previous one as MLX does
        def set_wired_limit(limit):
            wired.append(limit)
            return wired[-2] if len(wired) > 1 else 0
        monkeypatch.setattr(mx, "set_wired_limit", set_wired_limit)
        monkeypatch.setattr(mx, "synchronize", lambda *_: None)


@pytest.mark.parametrize("gb", sorted(MACS))
def test_metal_budget_is_the_recommended_working_set_less_what_is_in_use(monkeypatch, gb):
    info = MACS[gb]
    weights = 300 * 2**20
    stub_device(monkeypatch, "metal", info, active=weights + 2 * GIB)  # 2 GiB held besides the weights
    assert memory.backend() == "metal"
    assert memory.default_budget_bytes(counted=weights) == info["max_recommended_working_set_size"] - 2 * GIB
    assert memory.default_budget_bytes(counted=weights + 2 * GIB) == info["max_recommended_working_set_size"]


def test_a_16gb_mac_plans_within_metal_s_working_set_not_85_percent_of_ram(monkeypatch):
    """The issue's example: 0.85 x memory_size = 13.6 GiB before; the working set, 10.67 GiB, now."""
    stub_device(monkeypatch, "metal", MACS[16])
    assert 0.85 * MACS[16]["memory_size"] / GIB == pytest.approx(13.6)
    assert memory.default_budget_bytes() == 11453251584 < 0.85 * MACS[16]["memory_size"]


def test_metal_budget_never_negative_and_cpu_default_device_on_a_mac(monkeypatch):
    stub_device(monkeypatch, "metal", MACS[16], active=20 * GIB)
    assert memory.default_budget_bytes() == 0.0
    stub_device(monkeypatch, "cpu", MACS[16])  # mx.set_default_device(mx.cpu) on a Mac: half of RAM
    assert memory.backend() == "cpu"
    assert memory.default_budget_bytes() == 0.5 * memory.physical_memory()


def test_cuda_budget_is_85_percent_of_the_device_total(monkeypatch):
    stub_device(monkeypatch, "cuda", H200, active=5 * GIB)
    assert memory.backend() == "cuda"
    assert memory.default_budget_bytes() == 0.85 * 150_754_820_096


def test_cpu_budget_is_half_of_ram(monkeypatch):
    stub_device(monkeypatch, "cpu", CPU)
    assert memory.budget_bytes("cpu", CPU, 0, 64 * GIB) == 32 * GIB
    assert memory.default_budget_bytes() == 0.5 * memory.physical_memory()
    # a GPU device without the keys its backend should have: the CPU rule, not a crash
    assert memory.budget_bytes("metal", CPU, 0, 8 * GIB) == memory.budget_bytes("cuda", CPU, 0, 8 * GIB) == 4 * GIB



def test_physical_memory_without_sysconf_s_names_asks_sysctl_then_mlx(monkeypatch):
    """Some macOS Pythons lack ``SC_PAGE_SIZE``/``SC_PHYS_PAGES`` (ValueError: unrecognized configuration name,
    DataBiosphere/toil#587, con/duct#114), or the call fails (EINVAL on OS X 10.10, Tarsnap/scrypt#39):
    the RAM comes from ``sysctl -n hw.memsize``, else from Metal's ``memory_size``."""
    import subprocess

    def no_name(name):
        raise ValueError("unrecognized configuration name")

    monkeypatch.setattr(memory.os, "sysconf", no_name)
    monkeypatch.setattr(memory, "CGROUP_LIMITS", ())  # the machine's RAM, whatever container runs the test
    asked = []

    def sysctl(cmd, **kw):
        asked.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="17179869184\n", stderr="")

    monkeypatch.setattr(memory.subprocess, "run", sysctl)
    assert memory.physical_memory() == 16 * GIB
    assert asked == [["sysctl", "-n", "hw.memsize"]]

    def gone(cmd, **kw):
        raise FileNotFoundError(2, "No such file or directory", cmd[0])

    monkeypatch.setattr(memory.subprocess, "run", gone)
    stub_device(monkeypatch, "metal", MACS[24])
    assert memory.physical_memory() == 24 * GIB
    assert memory.default_budget_bytes() == MACS[24]["max_recommended_working_set_size"]


def test_a_container_s_memory_limit_caps_the_cpu_budget(monkeypatch, tmp_path):
    """Linux in a container (``docker run --memory``, a Kubernetes limit): the process may use its cgroup's
    limit, not the host's RAM. Half of a 256 GiB host's RAM under an 8 GiB limit was a 128 GiB budget,
    whose single pass the kernel's OOM killer ends without a word; now it is half of 8 GiB."""
    v2, v1 = tmp_path / "memory.max", tmp_path / "memory.limit_in_bytes"
    monkeypatch.setattr(memory, "CGROUP_LIMITS", (v2, v1))
    monkeypatch.setattr(memory.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 64 * 2**20}[name])
    stub_device(monkeypatch, "cpu", CPU)
    assert memory.physical_memory() == 256 * GIB  # no cgroup files: not Linux, or no container
    v2.write_text("8589934592\n")  # cgroup v2
    assert memory.physical_memory() == 8 * GIB and memory.default_budget_bytes() == 4 * GIB
    assert memory.run_budget_bytes(0) == 4 * GIB
    v2.write_text("max\n")  # no limit
    assert memory.physical_memory() == 256 * GIB
    v2.unlink()
    v1.write_text("9223372036854771712\n")  # cgroup v1's "no limit"
    assert memory.physical_memory() == 256 * GIB
    v1.write_text(f"{2 * GIB}\n")
    assert memory.physical_memory() == 2 * GIB

# ---- the plan auto picks for real model shapes (weights bfloat16, LoRA r=8 float32 on every linear) ----

SHAPES = {  # the models' config.json values
    "SmolLM2-135M": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True),
    "Llama-3.2-1B": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "Llama-3.1-8B": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
}


def model_args(name: str) -> ModelArgs:
    return ModelArgs(model_type="llama", rms_norm_eps=1e-5, **SHAPES[name])


def fixed_bytes(a: ModelArgs, rank: int = 8) -> int:
    """bf16 weights + LoRA (float32) x 3 (its gradients and AdamW's two moments), as Plan counts them."""
    D, I, H, kv = a.hidden_size, a.intermediate_size, a.num_attention_heads, a.num_key_value_heads
    dh = a.head_dim or D // H
    linears = [(D, H * dh), (D, kv * dh), (D, kv * dh), (H * dh, D), (D, I), (D, I), (I, D)]
    weights = a.vocab_size * D * (1 if a.tie_word_embeddings else 2) + a.num_hidden_layers * (
        sum(i * o for i, o in linears) + 2 * D) + D
    lora = a.num_hidden_layers * sum(rank * (i + o) for i, o in linears)
    return 2 * weights + 3 * 4 * lora


def pair_shape(a: ModelArgs, tokens: int) -> dict:
    """One pair of ``tokens`` tokens, prefix-shared: prompt 1/4, chosen and rejected 3/8 each."""
    return dict(tokens=tokens, targets=3 * tokens // 4, attention=((2, 5 * tokens // 8),), heads=a.num_attention_heads)


def test_model_sizes_are_the_published_parameter_counts():
    counts = {name: (fixed_bytes(model_args(name), 0)) // 2 for name in SHAPES}
    assert counts == {"SmolLM2-135M": 134_515_008, "Llama-3.2-1B": 1_235_814_400, "Llama-3.1-8B": 8_030_261_248}


# (layers per range, head chunk) per Mac RAM (16, 24, 64, 128 GB), Metal's budget; the single pass is (n, 0)
PLANS = {
    ("SmolLM2-135M", 1024): [(30, 0), (30, 0), (30, 0), (30, 0)],
    ("SmolLM2-135M", 2048): [(30, 0), (30, 0), (30, 0), (30, 0)],
    ("SmolLM2-135M", 4096): [(12, 1024), (19, 1024), (30, 0), (30, 0)],
    ("SmolLM2-135M", 8192): [(3, 1024), (5, 1024), (17, 1024), (30, 0)],
    ("Llama-3.2-1B", 1024): [(16, 0), (16, 0), (16, 0), (16, 0)],
    ("Llama-3.2-1B", 2048): [(5, 1024), (10, 1024), (16, 0), (16, 0)],
    ("Llama-3.2-1B", 4096): [(1, 1024), (3, 1024), (14, 1024), (16, 0)],
    ("Llama-3.2-1B", 8192): [(1, 1024), (1, 1024), (4, 1024), (9, 1024)],
    ("Llama-3.1-8B", 1024): [(1, 1024), (1, 1024), (32, 0), (32, 0)],
    ("Llama-3.1-8B", 2048): [(1, 1024), (1, 1024), (18, 1024), (32, 0)],
    ("Llama-3.1-8B", 4096): [(1, 1024), (1, 1024), (6, 1024), (19, 1024)],
    ("Llama-3.1-8B", 8192): [(1, 1024), (1, 1024), (2, 1024), (6, 1024)],
}


def checked_choice(a: ModelArgs, tokens: int, budget: float, fused: bool, kept_exp: bool = False) -> tuple[int, int]:
    """``choose``'s plan, after checking what makes it right: it fits with the margin and one more
    layer per range does not; when nothing fits, ranges of one layer (the smallest estimate).
    ``kept_exp``: dtrain's kernels (``engine.kernels: auto`` on the CPU)."""
    shape, fixed, n = pair_shape(a, tokens), fixed_bytes(a), a.num_hidden_layers
    plan, est = choose(a, n, 2, fused, shape, fixed, budget, AUTO_HEAD_CHUNK, kept_exp)
    if est * ESTIMATE_MARGIN > budget:  # weights or one layer's attention scores too large
        assert plan == (1, AUTO_HEAD_CHUNK)
    elif plan[0] < n:
        bigger = fixed + estimate_step_bytes(a, 2, shape, plan[0] + 1, AUTO_HEAD_CHUNK, fused, kept_exp)
        assert bigger * ESTIMATE_MARGIN > budget and plan[1] == AUTO_HEAD_CHUNK
    return plan


@pytest.mark.parametrize("name,tokens", sorted(PLANS))
def test_auto_plan_on_macs(monkeypatch, name, tokens):
    got = []
    for gb in sorted(MACS):
        stub_device(monkeypatch, "metal", MACS[gb])
        got.append(checked_choice(model_args(name), tokens, memory.default_budget_bytes(), fused=False))
    assert got == PLANS[name, tokens]


def test_auto_plan_on_a_16gb_mac_before_and_after():
    """1B at 2,048 tokens: 85% of a 16 GB Mac's RAM chose ranges of 8 layers, planned at 13.35 GiB with the
    margin, beyond Metal's 10.67 GiB working set; the working set gives ranges of 5 layers, 10.41 GiB."""
    a = model_args("Llama-3.2-1B")
    shape, fixed = pair_shape(a, 2048), fixed_bytes(a)
    working_set = MACS[16]["max_recommended_working_set_size"]
    before, est = choose(a, 16, 2, False, shape, fixed, 0.85 * MACS[16]["memory_size"], AUTO_HEAD_CHUNK)
    assert before == (8, AUTO_HEAD_CHUNK) and round(est * ESTIMATE_MARGIN / GIB, 2) == 13.35 > working_set / GIB
    after, est = choose(a, 16, 2, False, shape, fixed, working_set, AUTO_HEAD_CHUNK)
    assert after == (5, AUTO_HEAD_CHUNK) and round(est * ESTIMATE_MARGIN / GIB, 2) == 10.41



def test_auto_plan_counts_the_head_rows_a_short_pair_has_not_a_whole_chunk():
    """1B at 256 tokens (192 targets, one head chunk of 192 rows) within 4 GiB: ranges of 8 layers fit
    (3.98 GiB with the margin). Counting 1,024 head rows estimated every plan at 5.49 GiB or more, so
    auto said none fits and took ranges of one layer."""
    a = model_args("Llama-3.2-1B")
    plan, est = choose(a, 16, 2, False, pair_shape(a, 256), fixed_bytes(a), 4 * GIB, AUTO_HEAD_CHUNK)
    assert plan == (8, AUTO_HEAD_CHUNK) and round(est * ESTIMATE_MARGIN / GIB, 2) == 3.98
    assert checked_choice(a, 256, 4 * GIB, fused=False) == plan


# (H200 under CUDA, fused attention; a 64 GiB Linux CPU, dtrain's kernels), per length 1,024 .. 8,192
PLANS_CUDA_CPU = {
    "SmolLM2-135M": [((30, 0), (30, 0)), ((30, 0), (30, 0)), ((30, 0), (30, 0)), ((30, 0), (11, 1024))],
    "Llama-3.2-1B": [((16, 0), (16, 0)), ((16, 0), (16, 0)), ((16, 0), (8, 1024)), ((16, 0), (2, 1024))],
    "Llama-3.1-8B": [((32, 0), (17, 1024)), ((32, 0), (6, 1024)), ((32, 0), (2, 1024)), ((26, 1024), (1, 1024))],
}


@pytest.mark.parametrize("name", sorted(PLANS_CUDA_CPU))
def test_auto_plan_on_cuda_and_cpu(monkeypatch, name):
    a, got = model_args(name), []
    for tokens in (1024, 2048, 4096, 8192):
        stub_device(monkeypatch, "cuda", H200)
        on_h200 = checked_choice(a, tokens, memory.default_budget_bytes(), fused=True)
        stub_device(monkeypatch, "cpu", CPU)
        on_cpu = checked_choice(a, tokens, memory.budget_bytes("cpu", CPU, 0, 64 * GIB), fused=False, kept_exp=True)
        got.append((on_h200, on_cpu))
    assert got == PLANS_CUDA_CPU[name]


def test_plan_takes_the_device_budget_counting_its_weights_once(monkeypatch):
    model = make_tiny_model()
    weights = memory.weight_bytes(model)
    stub_device(monkeypatch, "metal", MACS[24], active=weights + 123)
    plan = Plan(model, 2, "auto", 0, 0.0)
    assert plan.memory_budget == MACS[24]["max_recommended_working_set_size"] - 123
    assert Plan(model, 2, "auto", 0, 5.0 * GIB).memory_budget == 5 * GIB  # a configured budget wins



@pytest.mark.parametrize("var", ["DTRAIN_LOCAL_RANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_ranks_on_one_mac_plan_within_their_share_of_it(monkeypatch, var):
    """``./launch -n 2`` (DTRAIN_LOCAL_RANKS) or ``mpirun -np 2`` on one Mac: two processes share its unified
    memory, so each plans within half of Metal's working set (half of half the RAM on the CPU) and wires half;
    CUDA ranks each have a GPU of their own. One rank: unchanged."""
    model = make_tiny_model()
    weights = memory.weight_bytes(model)
    ws = MACS[24]["max_recommended_working_set_size"]
    monkeypatch.setenv(var, "2")
    stub_device(monkeypatch, "metal", MACS[24], active=weights + 123)
    assert memory.default_budget_bytes(counted=weights) == ws // 2 - 123
    assert memory.run_budget_bytes(0) == ws // 2
    assert Plan(model, 2, "auto", 0, 0.0).memory_budget == ws // 2 - 123
    assert Plan(model, 2, "auto", 0, 5.0 * GIB).memory_budget == 5 * GIB  # a configured budget is each rank's
    wired = []
    stub_device(monkeypatch, "metal", MACS[24], wired=wired)
    with memory.wired_limit(model) as limit:
        assert limit == ws // 2 and wired == [ws // 2]
    notices = []
    stub_device(monkeypatch, "metal", dict(MACS[24], max_recommended_working_set_size=weights), wired=[])
    with memory.wired_limit(model, notices.append):
        pass
    assert notices == [f"the weights alone ({weights / GIB:.1f} GiB) exceed this rank's share (1 of 2 ranks on this "
                       f"Mac) of Metal's recommended working set ({weights // 2 / GIB:.1f} GiB): expect paging and "
                       f"slow steps; a smaller or quantized model fits"]
    stub_device(monkeypatch, "cpu", CPU)
    assert memory.default_budget_bytes() == 0.25 * memory.physical_memory()
    stub_device(monkeypatch, "cuda", H200)
    assert memory.default_budget_bytes() == 0.85 * H200["total_memory"]
    monkeypatch.setenv(var, "1")
    stub_device(monkeypatch, "metal", MACS[24])
    assert memory.default_budget_bytes() == ws


def test_a_local_rank_count_that_is_no_number_is_named(monkeypatch):
    monkeypatch.setenv("DTRAIN_LOCAL_RANKS", "two")
    stub_device(monkeypatch, "metal", MACS[24])
    with pytest.raises(UserError, match=r"DTRAIN_LOCAL_RANKS='two' in the environment is not a whole number"):
        memory.default_budget_bytes()

# ---- the wired limit ----

def test_wired_limit_set_to_the_working_set_and_restored(monkeypatch):
    wired, notices = [], []
    stub_device(monkeypatch, "metal", MACS[64], wired=wired)
    with memory.wired_limit(make_tiny_model(), notices.append) as limit:
        assert limit == 51539607552 and wired == [51539607552]
    assert wired == [51539607552, 0]  # the previous limit (MLX's default, 0) is back
    assert notices == []


def test_wired_limit_restored_when_the_run_fails(monkeypatch):
    wired = []
    stub_device(monkeypatch, "metal", MACS[16], wired=wired)
    with pytest.raises(RuntimeError):
        with memory.wired_limit(make_tiny_model()):
            raise RuntimeError("a step failed")
    assert wired == [11453251584, 0]


def test_wired_limit_notice_when_the_weights_alone_exceed_it(monkeypatch):
    model = make_tiny_model()
    weights = memory.weight_bytes(model)
    small = dict(MACS[16], max_recommended_working_set_size=weights - 1)
    wired, notices = [], []
    stub_device(monkeypatch, "metal", small, wired=wired)
    with memory.wired_limit(model, notices.append):
        pass
    assert notices == [f"the weights alone ({weights / GIB:.1f} GiB) exceed Metal's recommended working set "
                       f"({(weights - 1) / GIB:.1f} GiB): expect paging and slow steps; a smaller or quantized "
                       "model fits"]
    assert wired == [weights - 1, 0]
    stub_device(monkeypatch, "metal", dict(small, max_recommended_working_set_size=weights), wired=[])
    with memory.wired_limit(model, notices.append):
        pass
    assert len(notices) == 1  # equal is not beyond


@pytest.mark.parametrize("kind,info", [("cpu", CPU), ("cuda", H200)])
def test_wired_limit_changes_nothing_off_metal(monkeypatch, kind, info):
    wired, notices = [], []
    stub_device(monkeypatch, kind, info, wired=wired)
    with memory.wired_limit(make_tiny_model(), notices.append) as limit:
        assert limit is None
    assert wired == [] and notices == []


def test_trim_cache_empties_mlx_s_cache_only_when_peak_plus_cache_exceed_the_budget():
    from dtrain.memory import trim_cache

    a = mx.ones((512, 512))
    mx.eval(a)
    del a  # its 1 MiB buffer goes to MLX's cache
    cached = mx.get_cache_memory()
    assert cached >= 512 * 512 * 4
    room = mx.get_peak_memory() + cached
    assert trim_cache(room) is False and mx.get_cache_memory() == cached  # within the budget: kept for reuse
    assert trim_cache(room - 1) is True and mx.get_cache_memory() == 0


@pytest.mark.parametrize("budget_gb, emptied", [(1e-6, True), (1e6, False)])
def test_a_run_empties_the_cache_between_steps_only_over_its_budget(tmp_path, budget_gb, emptied):
    from types import SimpleNamespace

    from conftest import make_pairs, make_tiny_model
    from dtrain.config import load_config
    from dtrain.run.trainer import Hooks, train

    cfg = load_config(None, [f"train.output_dir={tmp_path}", "data.demo_pairs=1", "train.steps=3",
                             "train.global_batch_pairs=2", "train.micro_batch_pairs=2", "lora.rank=2",
                             "train.progress=false", f"engine.memory_budget_gb={budget_gb}"])
    loaded = SimpleNamespace(aliases=(), model=make_tiny_model(seed=0), tokenizer=None, identity="tiny",
                             source="tiny-llama", reference={"path": "tiny-llama"})
    pairs = make_pairs(8, seed=0)
    seen = []  # MLX's cache when each step begins, after the trim

    def before_step(step, run):
        seen.append(run.step.memory_budget)

    result = train(cfg, loaded=loaded, dataset=SimpleNamespace(train=pairs[:6], valid=pairs[6:], fingerprint="fp"),
                   hooks=Hooks(before_step=before_step))
    assert seen == [budget_gb * 2**30] * 3
    logged = [h["perf/cache_memory_gb"] for h in result.history]  # the cache each step began with
    assert all(c == 0 for c in logged) if emptied else all(c > 0 for c in logged)
