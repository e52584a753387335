"""Prefix caching of hybrid models (Qwen3-Next, Qwen3.5-MoE), fp32 on the CPU: a cached prefix
restores the linear layers' recurrent state from a snapshot taken at a page boundary
(engine/state_cache.py), so a hit equals a miss (greedy tokens identical, logprobs within
1e-4), for base and each adapter (one namespace each), over prompts of several pages in
chunks that do and do not end on page boundaries. A cached run of pages is a hit only up to
its last page with a snapshot: with snapshots evicted (a budget of one) it falls back to a
shorter hit, or to none. Preemption and aborts leave state slots, snapshots and pages as they
should be: nothing held, nothing pending."""

from __future__ import annotations

import pytest
import qwen3_next_fixtures as qf
from family_fixtures import FamilyFixtures, assert_same, run_greedy
from test_vs_transformers import greedy_params

from moelora import LLM
from moelora.engine.prefix_cache import namespace, page_hashes
from moelora.engine.state_cache import StateSnapshots

PAGE = 4
MAX_NUM_SEQS = 4
# chunks of 6 tokens: a lone request's chunks end at 6, 12, 18, ..., on a page boundary every
# other chunk; its prompt's chunk that crosses its last boundary before its last token ends
# there (a 41-token prompt: snapshots after 12, 24, 36 and 40 tokens)
OPTIONS = dict(page_size=PAGE, max_num_batched_tokens=6)
LONG = [(37 * i + 11) % 250 + 1 for i in range(90)]


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> FamilyFixtures:
    return FamilyFixtures(
        tmp_path_factory.mktemp("hybrid_prefix"),
        qf,
        request.config.getoption("--moelora-device"),
        max_loras=2,
        max_lora_rank=8,
        max_num_seqs=MAX_NUM_SEQS,
    )


def _assert_same(got, want) -> None:
    assert_same(got, want, 1e-4)  # the tolerance of test_qwen3_next.py, for the same reason


def _warm(llm: LLM, prompts: list[list[int]], loras: list[str | None]) -> None:
    """Each prompt alone, so its chunks (and snapshots) fall where OPTIONS says."""
    for prompt, lora in zip(prompts, loras):
        run_greedy(llm, [lora], [prompt], max_tokens=2)


def _assert_idle(llm: LLM) -> None:
    """Nothing held: state slots, pages, adapter slots; no snapshot row pending a commit."""
    stats = llm.engine.stats()
    assert stats.state_slots_used == 0 and stats.kv_pages_used == 0 and stats.lora_slot_refs == 0
    snapshots = llm.engine.scheduler.snapshots
    assert snapshots.num_pending == 0
    assert stats.state_snapshots_cached == snapshots.num_cached <= stats.state_snapshots_total


def _miss(fx: FamilyFixtures, arch: str, loras, prompts, **kwargs):
    llm = fx.llm(arch, enable_prefix_caching=False, **OPTIONS, **kwargs)
    return run_greedy(llm, loras, prompts)


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_a_hit_equals_a_miss(fx: FamilyFixtures, arch: str) -> None:
    """Prompts of 30 to 48 tokens, warmed one at a time under base, a and b, then asked again
    in one batch: the same prompt (hit at its last boundary before its last token, 40), a
    longer one (hit at the end of the shorter one's last snapshot, 40), the same tokens under
    another adapter (no hit: another namespace), and one that shares 5 pages with a cached
    prompt whose snapshots are at 12, 24 and 32 tokens (hit of 12: the longest shared run whose
    last page has a snapshot). Outputs equal an engine's without prefix caching."""
    base_prompt, b_prompt = LONG[:41], LONG[5:38]
    llm = fx.llm(arch, max_state_snapshots=16, **OPTIONS)  # room for the 11 snapshots
    _warm(llm, [base_prompt, base_prompt, b_prompt], [None, "a", "b"])
    assert llm.engine.stats().prefix_cache_hits == 0  # three namespaces, or other tokens
    queries = [base_prompt, base_prompt + LONG[60:67], b_prompt, b_prompt[:20] + LONG[70:80]]
    loras = [None, "a", "a", "b"]
    hit = run_greedy(llm, loras, queries)
    assert [o.num_cached_tokens for o in hit] == [40, 40, 0, 12]
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits == 92 and stats.state_snapshots_cached > 0
    assert stats.state_snapshots_total == 16
    _assert_same(hit, _miss(fx, arch, loras, queries))
    _assert_idle(llm)


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_an_evicted_snapshot_falls_back(fx: FamilyFixtures, arch: str) -> None:
    """One snapshot row: the second prompt's snapshots evict the first's. Asked again, the
    first prompt's pages are still cached but none ends on a snapshot, so nothing is taken
    from the cache (a hit without its state would be wrong); the second's hit restores the
    one snapshot, taken after 36 tokens: its chunk ending at 40 was planned while the step
    that took it was in flight (async scheduling), its one row pending, so page 10 got none
    and the hit falls back to 9 pages. Both equal an engine's without prefix caching."""
    first, second = LONG[:41], LONG[45:86]
    llm = fx.llm(arch, max_state_snapshots=1, **OPTIONS)
    _warm(llm, [first, second], [None, None])
    hashes = page_hashes(first, PAGE, namespace(None, None))
    assert llm.engine.pages.num_cached_run(hashes) == 10  # its pages stay cached
    prompts = [second, first]  # second first: its hit's restore comes before any new save
    hit = run_greedy(llm, [None, None], prompts)
    assert [o.num_cached_tokens for o in hit] == [36, 0]
    assert llm.engine.stats().state_snapshots_cached == 1
    _assert_same(hit, _miss(fx, arch, [None, None], prompts))
    _assert_idle(llm)


# prompts sharing prefixes, in base and a, long enough to need 8 to 11 pages of 4 tokens each
SHARED = [LONG[:30], LONG[:30] + LONG[50:58], LONG[10:40], LONG[:22]]
SHARED_LORAS: list[str | None] = [None, None, "a", None]


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_preemption_keeps_states_and_snapshots_consistent(fx: FamilyFixtures, arch: str) -> None:
    """16 pages for 4 requests that need up to 12 each, and two snapshot rows: requests are
    preempted (their pages, state slots and cached prefixes given back, recomputed later,
    possibly from a snapshot), cached pages and snapshots are evicted, twice over. Both runs
    equal an engine's without prefix caching, and nothing is held afterwards."""
    llm = fx.llm(arch, num_pages=16, max_state_snapshots=2, **OPTIONS)
    want = _miss(fx, arch, SHARED_LORAS, SHARED)
    for _ in range(2):
        _assert_same(run_greedy(llm, SHARED_LORAS, SHARED), want)
        _assert_idle(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().prefix_cache_hits > 0


@pytest.mark.parametrize("arch", qf.ARCHS)
def test_aborts_keep_states_and_snapshots_consistent(fx: FamilyFixtures, arch: str) -> None:
    """Two of four requests aborted mid-prefill, with a step in flight that takes snapshots:
    the others finish, nothing is held and no snapshot row stays pending; the four asked
    again (hits on what the first ones cached) equal an engine's without prefix caching. The
    default snapshot budget: one per running request (max_num_seqs)."""
    llm = fx.llm(arch, **OPTIONS)
    engine = llm.engine
    assert engine.stats().state_snapshots_total == MAX_NUM_SEQS
    for i, (prompt, lora) in enumerate(zip(SHARED, SHARED_LORAS)):
        engine.add_request(f"r{i}", prompt, greedy_params(4), lora)
    for _ in range(4):
        engine.step()
    engine.abort_request("r0")
    engine.abort_request("r2")
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)
    assert engine.stats().state_snapshots_cached > 0
    again = run_greedy(llm, SHARED_LORAS, SHARED)
    assert sum(o.num_cached_tokens for o in again) > 0
    _assert_same(again, _miss(fx, arch, SHARED_LORAS, SHARED))
    _assert_idle(llm)


def test_state_snapshots_rows() -> None:
    """Rows past the spare, handed out free first, then by evicting the least recently used;
    a pending row is never evicted; a hash cached twice keeps its first row; longest() finds
    the longest run whose last page has a snapshot; an owner's drop and a reset free rows."""
    snaps = StateSnapshots(2, first=5)
    a, b = snaps.take(), snaps.take()
    assert {a, b} == {5, 6} and snaps.num_pending == 2
    assert snaps.take() is None  # both pending
    snaps.cache(a, b"h1", owner=None)
    snaps.cache(b, b"h3", owner=7)
    assert snaps.longest([b"h1", b"h2", b"h3", b"h4"]) == 3
    assert snaps.longest([b"h1", b"h2"]) == 1 and snaps.longest([b"h2"]) == 0
    assert snaps.use(b"h1") == a  # h3 is now the least recently used
    c = snaps.take()
    assert c == b and not snaps.has(b"h3") and snaps.has(b"h1")
    snaps.cache(c, b"h1", owner=None)  # computed twice at once: the row goes back
    assert snaps.num_cached == 1 and snaps.num_pending == 0
    snaps.drop_owner(None)
    assert snaps.num_cached == 0
    snaps.cache(snaps.take(), b"h5", owner=7)
    snaps.reset()
    assert snaps.num_cached == 0 and snaps.num_pending == 0
