"""The draft-model proposer: its greedy drafts against the target's own greedy decoding (the
executor's engine), its state across partially accepted drafts against a fresh recomputation,
its KV blocks, a full pool, a foreign vocabulary, and a draft of the target's first N layers."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from services.common.sampling_params import SamplingParams
from services.scheduler.request.stop import StopConditions
from services.common.settings import parse_config, to_argv
from services.drafter.config import DraftModelSettings, DrafterConfig
from services.drafter.draft_model import DraftModelProposer
from services.drafter.proposer import DraftMethod, ProposerInfo
from services.executor.config import ExecutorConfig
from services.executor.forward_paths.decode_graphs import DecodeGraphSettings
from services.inprocess.engine import Engine, EngineConfig
from tests.helpers.engine_runs import generate_all

K = 4
VOCAB = 512
GREEDY = SamplingParams(temperature=0.0)


def settings(model_dir: Path, **overrides) -> DraftModelSettings:
    fields = {"draft_model": str(model_dir), "device": "cpu", "num_blocks": 256}
    return DraftModelSettings(**(fields | overrides))


def target_engine(model_dir: Path) -> Engine:
    return Engine(EngineConfig(ExecutorConfig(model=str(model_dir), dtype="float32", device="cpu", num_blocks=256)))


def target_greedy(engine: Engine, prompts: list[list[int]], k: int = K) -> list[list[int]]:
    """The target's greedy continuation of each prompt, k tokens, through the executor's runner."""
    stop = StopConditions(max_tokens=k, ignore_eos=True)
    return [d.token_ids for d in generate_all(engine, prompts, GREEDY, stop)]


@pytest.fixture(scope="module")
def proposer(stories_dir) -> DraftModelProposer:
    return DraftModelProposer(settings(stories_dir), K)


@pytest.fixture(scope="module")
def engine(stories_dir) -> Engine:
    return target_engine(stories_dir)


@pytest.fixture(scope="module")
def prompts(engine) -> list[list[int]]:
    """Natural text (BOS plus the model's own story, where drafts run long), random ids, and a
    prompt of one token; lengths cross block boundaries (block size 16)."""
    (story,) = target_greedy(engine, [[1]], k=120)
    rng = random.Random(7)
    return [[1] + story[:40], [1] + story[:15], [rng.randrange(3, VOCAB) for _ in range(33)], [1],
            [1] + story[:100]]


def test_full_depth_draft_equals_the_targets_greedy_continuation(proposer, engine, prompts):
    session = proposer.new_session()
    for seq_id, prompt in enumerate(prompts):
        session.open(seq_id, prompt)
    drafts = session.propose_batch(list(range(len(prompts))))
    assert drafts == target_greedy(engine, prompts)
    # A smaller k is a prefix; the order of the ids is the order of the drafts.
    assert session.propose_batch([3, 0], num_tokens=2) == [drafts[3][:2], drafts[0][:2]]
    assert session.propose_batch([1], num_tokens=99) == [drafts[1]]  # capped at the configured k
    session.close_all()


def test_partial_acceptance_keeps_the_draft_state_exact(proposer, prompts):
    """Accept 0..k tokens of each draft, then a token the draft did not predict (a correction,
    or the bonus after a full acceptance), every other round one more (two steps' tokens in one
    delta, as after a step that went without drafts): the next drafts equal those of a fresh
    session that computes the whole sequence from scratch, and the K/V of accepted drafts is reused."""
    rng = random.Random(3)
    session = proposer.new_session()
    known = {seq_id: list(prompt) for seq_id, prompt in enumerate(prompts[:4])}
    for seq_id, tokens in known.items():
        session.open(seq_id, tokens)
    drafts = dict(zip(known, session.propose_batch(list(known))))
    for round_ in range(2 * (K + 1)):
        for offset, seq_id in enumerate(known):
            accepted = (round_ + offset) % (K + 1)  # every count 0..k for every sequence
            draft = drafts[seq_id]
            extra = rng.choice([t for t in range(3, VOCAB) if accepted == len(draft) or t != draft[accepted]])
            gained = draft[:accepted] + [extra] + ([rng.randrange(3, VOCAB)] if round_ % 2 else [])
            before = len(known[seq_id])
            session.append(seq_id, gained)
            known[seq_id] += gained
            # Drafts 1..k-1 were fed to the model; those accepted keep their K/V.
            assert session.num_computed(seq_id) == before + min(accepted, K - 1)
        drafts = dict(zip(known, session.propose_batch(list(known))))
        fresh = proposer.new_session()
        for seq_id, tokens in known.items():
            fresh.open(seq_id, tokens)
        assert drafts == dict(zip(known, fresh.propose_batch(list(known)))), f"round {round_}"
        fresh.close_all()
    session.close_all()


def test_a_repeated_proposal_without_new_tokens_is_the_same(proposer, prompts):
    session = proposer.new_session()
    session.open(5, prompts[0])
    first = session.propose_batch([5])
    assert session.propose_batch([5]) == first
    session.append(5, [])  # an empty delta changes nothing either
    assert session.propose_batch([5]) == first
    session.close_all()


def test_closed_sequences_free_their_blocks(proposer, prompts):
    free = proposer.pool.num_free
    session = proposer.new_session()
    session.open(1, prompts[0])  # 41 tokens + 3 fed drafts: 44 slots, 3 blocks of 16
    session.open(2, prompts[3])  # 1 token + 3: one block
    session.propose_batch([1, 2])
    assert (session.num_blocks(1), session.num_blocks(2)) == (3, 1)
    assert proposer.pool.num_free == free - 4
    session.close(1)
    session.close(1)  # unknown ids are ignored
    assert proposer.pool.num_free == free - 1 and 1 not in session and len(session) == 1
    session.close_all()
    assert proposer.pool.num_free == free and len(session) == 0


def test_a_full_pool_gives_empty_drafts_not_errors(stories_dir, engine, prompts):
    small = DraftModelProposer(settings(stories_dir, num_blocks=4), K)  # 64 slots
    session = small.new_session()
    session.open(1, prompts[0][:30])  # 30 + 3 slots: 3 blocks
    session.open(2, prompts[1])       # 16 + 3 slots: 2 blocks, only 1 left
    session.open(3, list(range(3, 70)))  # longer than the whole pool
    expected = target_greedy(engine, [prompts[0][:30]])[0]
    assert session.propose_batch([1, 2, 3]) == [expected, [], []]
    assert small.pool.num_free == 1 and session.num_pool_full == 2
    session.close(1)
    assert session.propose_batch([2, 3]) == [target_greedy(engine, [prompts[1]])[0], []]


def test_drafts_stop_at_the_models_context_limit(proposer):
    limit = proposer.max_model_len  # 512 for stories260K
    session = proposer.new_session()
    session.open(1, [5] * (limit - 2))
    session.open(2, [5] * limit)
    short, none = session.propose_batch([1, 2])
    assert len(short) == 2 and none == []
    session.close_all()


def test_a_draft_with_another_vocabulary_is_refused(stories_dir, tmp_path, proposer):
    target = tmp_path / "target"
    target.mkdir()
    config = json.loads((stories_dir / "config.json").read_text()) | {"vocab_size": 600}
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"draft_model {stories_dir} has vocab_size 512 but target_model {target} "
                                         "has 600: a draft must share the target's vocabulary"):
        DraftModelProposer(settings(stories_dir, target_model=str(target)), K)
    # The same vocabulary passes; a token id past it is refused by name before it reaches the model.
    assert DraftModelProposer(settings(stories_dir, target_model=str(stories_dir), num_blocks=1), K).vocab_size == VOCAB
    session = proposer.new_session()
    with pytest.raises(ValueError, match=r"sequence 4: token id 512 is outside the draft model's vocabulary \[0, 512\)"):
        session.open(4, [1, 512])
    session.open(4, [1])
    with pytest.raises(ValueError, match=r"sequence 4: token id -1 is outside"):
        session.append(4, [-1])
    session.close_all()


def truncated_checkpoint(model_dir: Path, num_layers: int, out: Path) -> Path:
    """A copy of the model with only its first layers: what a draft of N layers must compute."""
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    config = json.loads((model_dir / "config.json").read_text()) | {"num_hidden_layers": num_layers}
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers:
                    tensors[name] = handle.get_tensor(name)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("num_layers", [1, 3])
def test_self_speculative_draft_runs_the_first_n_layers(stories_dir, tmp_path, prompts, proposer, num_layers):
    draft = DraftModelProposer(settings(stories_dir, draft_layers=num_layers, target_model=str(stories_dir)), K)
    assert draft.model_config.num_layers == num_layers and len(draft.kv_cache.layers) == num_layers
    reference = target_engine(truncated_checkpoint(stories_dir, num_layers, tmp_path / "truncated"))
    session = draft.new_session()
    for seq_id, prompt in enumerate(prompts):
        session.open(seq_id, prompt)
    drafts = session.propose_batch(list(range(len(prompts))))
    assert drafts == target_greedy(reference, prompts)
    full = proposer.new_session()
    for seq_id, prompt in enumerate(prompts):
        full.open(seq_id, prompt)
    assert drafts != full.propose_batch(list(range(len(prompts))))  # the later layers were dropped
    full.close_all()


def test_settings_are_checked_by_name(stories_dir):
    with pytest.raises(ValueError, match="draft_layers 6 exceeds the draft model's num_hidden_layers 5"):
        DraftModelProposer(settings(stories_dir, draft_layers=6), K)
    with pytest.raises(ValueError, match="draft_model must name a model directory when method is draft_model"):
        DrafterConfig(method=DraftMethod.DRAFT_MODEL).validate()
    with pytest.raises(ValueError, match="draft_layers must be >= 0"):
        DraftModelSettings(draft_model="x", draft_layers=-1).validate()
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[1, 32\], got 0"):
        DrafterConfig(method=DraftMethod.DRAFT_MODEL, draft=DraftModelSettings(draft_model="x"),
                      num_speculative_tokens=0).validate()
    DrafterConfig(method=DraftMethod.DRAFT_MODEL, draft=DraftModelSettings(draft_model="x")).validate()  # loads nothing


def test_draft_model_flags_keep_their_names_and_variables():
    config = parse_config(DrafterConfig, ["--method", "draft_model", "--draft-layers", "3", "--device", "cpu"],
                          env={"TOKENMILL_DRAFTER_DRAFT_MODEL": "/m", "TOKENMILL_DRAFTER_NUM_BLOCKS": "8"})
    assert config.draft == DraftModelSettings(draft_model="/m", draft_layers=3, device="cpu", num_blocks=8)
    assert parse_config(DrafterConfig, to_argv(config), env={}) == config


def test_info_names_the_method_and_vocabulary(proposer, stories_dir):
    assert proposer.info() == ProposerInfo(DraftMethod.DRAFT_MODEL, K, draft_model_path=str(stories_dir),
                                           vocab_size=VOCAB)


@pytest.mark.gpu
def test_on_cuda_the_full_depth_draft_equals_the_targets_greedy_continuation(stories_dir, prompts):
    """The pool sized from free device memory, the Triton backend, fp32: the same drafts as the
    target's greedy decoding on the same device."""
    draft = DraftModelProposer(settings(stories_dir, device="cuda", dtype="float32", num_blocks=0), K)
    assert draft.backend_name == "triton" and draft.pool.num_blocks > 0
    session = draft.new_session()
    for seq_id, prompt in enumerate(prompts):
        session.open(seq_id, prompt)
    cuda_target = Engine(EngineConfig(ExecutorConfig(model=str(stories_dir), dtype="float32", device="cuda",
                                                     num_blocks=256,
                                                     decode_graphs=DecodeGraphSettings(enforce_eager=True))))
    assert session.propose_batch(list(range(len(prompts)))) == target_greedy(cuda_target, prompts)
