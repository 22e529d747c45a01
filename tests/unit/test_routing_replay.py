"""Rollout routing replay: the transformers engine records the experts of every position (the whole prompt's, or its
last's, and the response's), keyed by decoder layer, the rollout shard stores them, and the trainer's MoE blocks
route to them (steps/model/moe.py:replaying), in one process and under EP = 2 on gloo (processes spawned here).
vLLM's layout, from its own capture code: tests/loop/test_vllm_routes.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from moeloop.steps.engines.engine import Sampling, TransformersEngine
from moeloop.steps.errors import MoeloopError
from moeloop.steps.model.moe import MoeBlock, Routes, replaying
from moeloop.steps.model.policy import build_tokenizer, load_policy_shard, save_policy, token_logprobs
from moeloop.steps.rl.batch import ExperienceBatch, experience_batch, recorded_routes
from moeloop.steps.rl.router_health import RouterHealth
from moeloop.steps.storage.experience import (
    EPISODE_COLUMNS,
    ROLLOUT_SCHEMA,
    parse_table,
    rollout_columns,
    rollout_schema,
    table_bytes,
)
from tests.unit.test_moe import FAMILY_NAMES, TOP_K, tiny_config
from tests.distributed.test_moe_ep import run_ranks

PROMPTS = [[2, 3, 4], [5, 6], [7, 8, 9, 10]]


def save_models(folder: Path, family: str = "qwen3_moe") -> tuple[Path, Path]:
    """A random tiny policy of the family (a DeepSeek-V3 router's correction bias random too, where HF's is zeros),
    and a copy whose routers are perturbed enough that some tokens route elsewhere."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family=family))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(std=0.1)
    tokenizer = build_tokenizer(["abc"])
    save_policy(model, tokenizer, folder / "policy")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
                parameter.add_(0.5 * parameter.std() * torch.randn_like(parameter))
    save_policy(model, tokenizer, folder / "perturbed")
    return folder / "policy", folder / "perturbed"


def recorded_batch(checkpoint: Path, prompt_routes: str = "all") -> ExperienceBatch:
    """Two samples per prompt from the transformers engine on checkpoint, with their routes, packed for the trainer."""
    engine = TransformersEngine(checkpoint)
    sampling = Sampling(n=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=0, record_routing=True,
                        prompt_routes=prompt_routes)  # fmt: skip
    generated = zip(PROMPTS, engine.generate(PROMPTS, sampling), strict=True)
    samples = [(prompt, completion) for prompt, completions in generated for completion in completions]
    for prompt, completion in samples:
        prompt_positions = len(prompt) if prompt_routes == "all" else 1
        assert completion.routed_experts.shape == (prompt_positions + len(completion.token_ids) - 1, 2, TOP_K)
        assert completion.routed_experts.dtype == np.uint8  # 8 experts
    rollouts = {
        "prompt_token_ids": [p for p, _ in samples],
        "response_token_ids": [c.token_ids for _, c in samples],
        "behavior_logprobs": [c.logprobs for _, c in samples],
        "routed_experts": [c.routed_experts.reshape(-1) for _, c in samples],
        "routed_layers": [list(engine.routed_layers)] * len(samples),
        "sample_id": [f"s{i}" for i in range(len(samples))],
        "prompt_id": [i // 2 for i in range(len(samples))],
    }
    assert recorded_routes(rollouts)
    return experience_batch(rollouts, {f"s{i}": 0.0 for i in range(len(samples))}, top_k=TOP_K)


def routes(batch: ExperienceBatch, rows: slice | torch.Tensor = slice(None)) -> Routes:
    """The batch's recorded routes in its padded layout ([b, T, L, K]), as a padded forward takes them."""
    sampled_BT = batch.response_mask_BT.roll(-1, 1)  # position t's forward sampled token t + 1
    return Routes(batch.routes_BTLK[rows], batch.route_layers, sampled_BT[rows])


def trainer(checkpoint: Path, dispatcher: str = "auto", ep_group=None) -> torch.nn.Module:
    return load_policy_shard(checkpoint, dispatcher, "grouped_mm", ep_group, torch.device("cpu"))[0]


def agreement(model: torch.nn.Module, batch: ExperienceBatch) -> dict[str, float]:
    """The share of recorded (position, layer) pairs the model's router picks alike: at the response's positions
    and at the prompt's (where recorded)."""
    health = RouterHealth.of(model, torch.device("cpu"))
    with torch.no_grad():
        _, router_logits_L = token_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT)
    health.add(router_logits_L, batch.attention_mask_BT, routes(batch))
    return {key: value for key, value in health.report().items() if key.startswith("routing_agreement")}


def record_dispatches(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (experts, weights) the model's MoE blocks hand their dispatcher, in call order (layer order)."""
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    for dispatcher in {id(m.dispatcher): m.dispatcher for m in model.modules() if isinstance(m, MoeBlock)}.values():
        dispatch = dispatcher.dispatch

        def recording(x_TH, topk_idx_TK, topk_weights_TK, dispatch=dispatch):
            calls.append((topk_idx_TK.detach().clone(), topk_weights_TK.detach().clone()))
            return dispatch(x_TH, topk_idx_TK, topk_weights_TK)

        dispatcher.dispatch = recording
    return calls


@pytest.mark.parametrize("prompt_routes", ["all", "last"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_routes_of_the_same_model_replay_to_the_same_forward_exactly(
    tmp_path: Path, family: str, prompt_routes: str
) -> None:
    """The transformers engine records every family's routes, keyed by decoder layer (DeepSeek-V3's first layer is
    dense: its MoE layers are 1 and 2), the whole prompt's or its last position's, and replaying them is the free
    forward to the bit."""
    policy, _ = save_models(tmp_path, family)
    batch = recorded_batch(policy, prompt_routes)
    assert batch.route_layers == ((1, 2) if family == "deepseek_v3" else (0, 1))
    model = trainer(policy).eval()
    # RouterHealth routes as each family does (DeepSeek-V3: its groups and correction bias), so it agrees for every
    # one, at the response's positions and at the prompt's.
    want = {"routing_agreement": 1.0} | ({"routing_agreement_prompt": 1.0} if prompt_routes == "all" else {})
    assert agreement(model, batch) == want
    recorded_BT = batch.routes_BTLK[..., 0, 0] >= 0
    sampled_BT = batch.response_mask_BT.roll(-1, 1)
    expected_BT = sampled_BT | (batch.attention_mask_BT.bool() & ~batch.response_mask_BT & (prompt_routes == "all"))
    assert torch.equal(recorded_BT, expected_BT)  # every forward position but the last token's, or the response's
    with torch.no_grad():
        free_BTV = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
        with replaying(model, routes(batch)):
            replayed_BTV = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_mask_BT).logits
    assert torch.equal(replayed_BTV, free_BTV)
    assert all(m.replay_TK is None for m in model.modules() if isinstance(m, MoeBlock))  # the context cleans up


def expected_routing(routes_TK: torch.Tensor, logits_TE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recorded experts where there are some, the router's own top-k elsewhere; weights from this router's
    softmax at those experts, renormalised (tiny_config has norm_topk_prob)."""
    own_TK = torch.topk(logits_TE, TOP_K, dim=-1).indices
    experts_TK = torch.where(routes_TK >= 0, routes_TK, own_TK)
    weights_TK = torch.softmax(logits_TE.float(), dim=-1).gather(1, experts_TK)
    return experts_TK, weights_TK / weights_TK.sum(1, keepdim=True)


def test_a_perturbed_models_routes_are_used_token_by_token_and_the_router_still_learns(tmp_path: Path) -> None:
    policy, perturbed = save_models(tmp_path)
    batch = recorded_batch(perturbed)
    model = trainer(policy).train()
    assert agreement(model, batch)["routing_agreement"] < 0.95  # the perturbed routers do pick other experts
    calls = record_dispatches(model)
    with replaying(model, routes(batch)):
        logprobs_BT, router_logits_L = token_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT)
    assert len(calls) == len(router_logits_L) == 2
    for layer, ((experts_TK, weights_TK), logits_TE) in enumerate(zip(calls, router_logits_L, strict=True)):
        routes_TK = batch.routes_BTLK[:, :, layer].reshape(-1, TOP_K)
        want_experts_TK, want_weights_TK = expected_routing(routes_TK, logits_TE.detach())
        assert torch.equal(experts_TK, want_experts_TK), layer
        torch.testing.assert_close(weights_TK, want_weights_TK, rtol=1e-6, atol=1e-7)
    (-logprobs_BT[batch.response_mask_BT].sum()).backward()
    gates = [m.top_k_router.weight for m in model.modules() if isinstance(m, MoeBlock)]
    assert all(gate.grad is not None and gate.grad.abs().sum() > 0 for gate in gates)


def check_replay_under_ep(rank: int, world_size: int, policy: Path, batch: ExperienceBatch, want: dict) -> None:
    model = trainer(policy, "all_to_all", dist.group.WORLD).train()
    rows = torch.arange(len(batch.input_ids_BT)).tensor_split(world_size)[rank]
    calls = record_dispatches(model)
    routes_bTLK = batch.routes_BTLK[rows]
    with replaying(model, routes(batch, rows)):
        logprobs_bT, router_logits_L = token_logprobs(model, batch.input_ids_BT[rows], batch.attention_mask_BT[rows])
    torch.testing.assert_close(logprobs_bT, want["logprobs_BT"][rows], rtol=1e-5, atol=1e-5)
    for layer, ((experts_TK, _), logits_TE) in enumerate(zip(calls, router_logits_L, strict=True)):
        want_experts_TK, _ = expected_routing(routes_bTLK[:, :, layer].reshape(-1, TOP_K), logits_TE.detach())
        assert torch.equal(experts_TK, want_experts_TK), layer
    (-logprobs_bT[batch.response_mask_BT[rows]].sum()).backward()
    gates = [m.top_k_router.weight for m in model.modules() if isinstance(m, MoeBlock)]
    for gate, want_grad in zip(gates, want["gate_grads"], strict=True):
        dist.all_reduce(gate.grad)  # the routers are replicated: their gradient is the sum over the ranks' tokens
        torch.testing.assert_close(gate.grad, want_grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_replay_under_ep2_routes_every_rank_to_the_recorded_experts(tmp_path: Path) -> None:
    policy, perturbed = save_models(tmp_path)
    batch = recorded_batch(perturbed)
    model = trainer(policy).train()
    with replaying(model, routes(batch)):
        logprobs_BT, _ = token_logprobs(model, batch.input_ids_BT, batch.attention_mask_BT)
    (-logprobs_BT[batch.response_mask_BT].sum()).backward()
    want = {
        "logprobs_BT": logprobs_BT.detach(),
        "gate_grads": [m.top_k_router.weight.grad for m in model.modules() if isinstance(m, MoeBlock)],
    }
    run_ranks(check_replay_under_ep, 2, tmp_path, policy, batch, want)


def old_shard_bytes(routes: list[int] | None = None) -> bytes:
    """A shard as written before the routed_experts column existed; or, given routes (the response's only, uint16),
    before the routed_layers column did (and the episodes' columns, which came after both)."""
    names = {"routed_layers", *EPISODE_COLUMNS} | ({"routed_experts"} if routes is None else set())
    old_schema = pa.schema([field for field in ROLLOUT_SCHEMA if field.name not in names])
    row = {
        "sample_id": ["1-0-0"], "iteration": [1], "shard": [0], "prompt_id": [0], "sample_index": [0],
        "prompt_text": ["ab"], "prompt_token_ids": [[2, 3]], "response_token_ids": [[4, 1]], "response_text": ["c"],
        "behavior_logprobs": [[-0.5, -0.1]], "finish_reason": ["stop"], "policy_version": [0],
        "engine": ["transformers"], **({"routed_experts": [routes]} if routes is not None else {}),
    }  # fmt: skip
    return table_bytes(pa.table(row, schema=old_schema))


def test_old_shards_read_without_routes_and_replay_refuses_them_naming_the_column(tmp_path: Path) -> None:
    from moeloop.steps.rl.update import policy_update
    from tests.conftest import small_config

    table = parse_table(old_shard_bytes(), "old.parquet", ROLLOUT_SCHEMA)
    assert table.schema.equals(ROLLOUT_SCHEMA) and table["routed_experts"].null_count == 1
    rollouts = rollout_columns(table)
    assert not recorded_routes(rollouts) and table["routed_layers"].null_count == 1
    batch = experience_batch(rollouts, {"1-0-0": 1.0})
    assert batch.routes_BTLK is None
    config = small_config(iterations=1, algorithm={"routing_replay": "rollout"})
    policy, _ = save_models(tmp_path)
    with pytest.raises(MoeloopError, match="routed_experts"):
        policy_update(trainer(policy), batch.behavior_logprobs_BT, None, batch, config, seed=0)


def test_old_shards_routes_read_as_the_response_positions_of_the_models_moe_layers() -> None:
    """A shard from before routed_layers: uint16 ids of the response's positions, the MoE layers in order (here
    DeepSeek-V3's 1 and 2, which the train step passes)."""
    routes = [3, 0, 1, 2, 7, 6, 5, 4]  # 2 response tokens x 2 layers x top 2
    table = parse_table(old_shard_bytes(routes), "old.parquet", ROLLOUT_SCHEMA)
    assert table["routed_experts"].type == pa.list_(pa.uint16()) and table["routed_layers"].null_count == 1
    batch = experience_batch(rollout_columns(table), {"1-0-0": 1.0}, top_k=2, moe_layers=(1, 2))
    assert batch.route_layers == (1, 2) and batch.routes_BTLK.dtype == torch.int16
    # Position 1 (the prompt's last) sampled the first response token; position 2 the second.
    assert batch.routes_BTLK[0, 1:3].reshape(-1).tolist() == routes
    assert (batch.routes_BTLK[0, 0] == -1).all() and (batch.routes_BTLK[0, 3:] == -1).all()


@pytest.mark.parametrize("experts, id_type", [(8, pa.uint8()), (256, pa.uint8()), (384, pa.uint16())])
def test_the_shard_schema_stores_routes_in_the_narrowest_type(experts: int, id_type: pa.DataType) -> None:
    """A row's routes and layers survive the Parquet round trip, the ids in the narrowest type that holds the
    model's; shards of either type read, and concatenate with an old shard's."""
    routes = np.array([3, 0, 1, 2, 7, 6, 5, experts - 1])  # 2 positions x 2 layers x top 2
    columns = {name: [None] for name in ROLLOUT_SCHEMA.names}
    columns.update(sample_id=["1-0-0"], iteration=[1], shard=[0], routed_experts=[routes], routed_layers=[[1, 2]])
    data = table_bytes(pa.table(columns, schema=rollout_schema(experts)))
    read = parse_table(data, "new.parquet", ROLLOUT_SCHEMA)
    assert read["routed_experts"].type == pa.list_(id_type) and read["routed_layers"].to_pylist() == [[1, 2]]
    [ids] = rollout_columns(read)["routed_experts"]
    assert ids.dtype == id_type.to_pandas_dtype() and ids.tolist() == routes.tolist()
    old = parse_table(old_shard_bytes([0] * 8), "old.parquet", ROLLOUT_SCHEMA)
    both = pa.concat_tables([read, old], promote_options="permissive")
    assert both["routed_experts"].to_pylist() == [routes.tolist(), [0] * 8]


@pytest.mark.slow
def test_a_replayed_gspo_run_records_stores_and_replays_the_routes(run_root: Path, tmp_path: Path) -> None:
    """One iteration, its steps in this process: the transformers engine records, the shards hold the column, and
    the train step replays it (GSPO-token, token masking), reporting the routers' health and the masked share."""
    from moeloop.steps.storage.experience import read_rollouts
    from moeloop.steps.storage.run import RunStorage
    from tests.conftest import SMALL_TRANSFORMERS_ROLLOUT, run_in_process, small_config
    from moeloop.workflows.dag import run_uri

    algorithm = {"routing_replay": "rollout", "importance_level": "sequence_token", "mismatch": {"level": "token"}}
    config = small_config(iterations=1, rollout=SMALL_TRANSFORMERS_ROLLOUT, algorithm=algorithm)
    uri = run_uri(config, str(run_root))
    run_in_process(config, uri)
    storage = RunStorage(uri)
    rollouts = read_rollouts(storage, 1, config.rollout.num_shards).to_pydict()
    samples = zip(rollouts["prompt_token_ids"], rollouts["response_token_ids"], rollouts["routed_experts"], strict=True)
    for prompt, response, routes in samples:  # the whole prompt's (prompt_routes all) and the response's
        shape = config.model.tiny
        assert len(routes) == (len(prompt) + len(response) - 1) * shape.num_hidden_layers * shape.num_experts_per_tok
    assert rollouts["routed_layers"] == [list(range(shape.num_hidden_layers))] * len(rollouts["sample_id"])
    train = storage.read_json(storage.report(1, "train"))
    # Engine and trainer both fp32 on the same checkpoint (pi_old's pass): their routers agree but for near-ties.
    assert train["routing_agreement"] > 0.95 and 0 <= train["mismatch_masked"] < 0.05
    assert train["routing_agreement_prompt"] > 0.95  # the whole prompt's routes, recorded and replayed
    metrics = storage.read_json(storage.metrics(1))
    assert metrics["router"]["routing_agreement"] == train["routing_agreement"]
    assert metrics["router"]["load_imbalance"] == train["router_load_imbalance"] >= 0
    assert metrics["mismatch_masked"] == train["mismatch_masked"]


@pytest.mark.parametrize(
    "sections",
    [{"algorithm": {"routing_replay": "rollout"}}, {"rollout": {"record_routing": True, "engine": "vllm"}}],
    ids=["replay", "record"],
)
def test_recording_routes_with_vllm_on_cpu_is_refused_before_anything_runs(
    sections: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM returns routed experts from its Model Runner V2 only, on a GPU: here (no CUDA) the local runner refuses
    the run in one line before it writes anything, and the engine refuses to build (the rollout pod's check)."""
    from moeloop.steps.config import parse_config
    from moeloop.steps.engines.vllm_engine import VLLMEngine
    from tests.unit.test_importance import BASE
    from moeloop.workflows.local.runner import preflight

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = {**BASE, **sections, "rollout": {"engine": "vllm", **sections.get("rollout", {})}}
    config = parse_config(data, "c.yaml")  # a cluster's rollout pods have GPUs: the config itself is valid
    with pytest.raises(MoeloopError, match="need vLLM on a GPU") as error:
        preflight(config)
    assert "\n" not in str(error.value)
    with pytest.raises(MoeloopError, match="need vLLM on a GPU"):
        VLLMEngine(tmp_path, config.rollout.vllm, record_routing=True)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("prompt_positions", [1, 4], ids=["last", "all"])
def test_vllm_routed_experts_become_the_completions_routes_at_the_moe_layers_columns(prompt_positions: int) -> None:
    """vLLM's `CompletionOutput.routed_experts`, [positions, decoder layers, k] from routed_experts_prompt_start,
    at the MoE layers' columns (here layers 1 and 2 of 3); a count that does not match the request is refused. The
    output is a stand-in object with the attributes vLLM 0.32's has (GPU vLLM, which makes real ones, does not run
    here; tests/loop/test_vllm_routes.py takes the layout from vLLM's own capture)."""
    from types import SimpleNamespace

    from moeloop.steps.engines.vllm_engine import VLLMEngine

    positions = prompt_positions + 2  # and the response's first two of three tokens
    routed_TLK = np.arange(positions * 3 * 4, dtype=np.uint8).reshape(positions, 3, 4)
    routed_TLK[:, 0] = 0  # a dense layer's column
    sample = SimpleNamespace(
        token_ids=[5, 6, 1], logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in (5, 6, 1)], finish_reason="stop",
        stop_reason=None, routed_experts=routed_TLK,
    )  # fmt: skip
    completion = VLLMEngine._completion(sample, (1, 2), prompt_positions)
    assert completion.routed_experts.tolist() == routed_TLK[:, 1:].tolist() and completion.finish_reason == "stop"
    assert VLLMEngine._completion(sample, None, prompt_positions).routed_experts is None
    with pytest.raises(MoeloopError, match=f"routed experts for {positions - 1} positions of a 3-token response"):
        VLLMEngine._completion(SimpleNamespace(**{**vars(sample), "routed_experts": routed_TLK[1:]}), (1, 2),
                               prompt_positions)  # fmt: skip
