"""block_manager.py: block tables, reference counts, prefix caching, eviction and fork.

Pure bookkeeping (no tensors), so every test runs on the CPU in milliseconds. The last test drives
random sequences of calls (hypothesis) and checks the books after every one of them.
"""

import pytest

import block_manager
from block_manager import BlockManager, OutOfBlocks

BS = 4  # block size of most tests: small enough to count by hand


def started(m: BlockManager, tokens: list[int], register: bool = True) -> tuple[list[int], int]:
    """What the scheduler and engine do for a new sequence: take the cached prefix, grow the table
    to hold the prompt, compute it, and name its full blocks. -> (table, tokens served by the cache)"""
    table: list[int] = []
    hit = m.take_prefix(table, tokens)
    m.grow(table, len(tokens))
    if register:
        m.register(table, tokens, len(tokens))
    return table, hit


def free_blocks(m: BlockManager) -> list[int]:
    """Every block that can be handed out now (free, or parked)."""
    return list(m._free) + list(m._parked)


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


# --- allocation -------------------------------------------------------------------------------


def test_rejects_an_empty_pool():
    with pytest.raises(ValueError):
        BlockManager(0, BS)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


@pytest.mark.parametrize("n_tokens, blocks", [(0, 0), (1, 1), (BS - 1, 1), (BS, 1), (BS + 1, 2), (3 * BS, 3)])
def test_blocks_for_rounds_up(n_tokens, blocks):
    assert BlockManager(8, BS).blocks_for(n_tokens) == blocks


def test_a_fresh_pool_is_all_free():
    m = BlockManager(8, BS)
    assert (m.num_free, m.num_used, m.num_cached) == (8, 0, 0)
    assert m.ref_count == [0] * 8


def test_grow_takes_one_block_per_block_size_tokens():
    m = BlockManager(8, BS)
    table: list[int] = []
    m.grow(table, 1)
    assert table == [0]  # block 0 is handed out first
    m.grow(table, BS)  # still fits in the first block
    assert table == [0]
    m.grow(table, BS + 1)
    assert table == [0, 1]
    m.grow(table, 3 * BS)
    assert table == [0, 1, 2]
    m.grow(table, 2)  # never shrinks
    assert table == [0, 1, 2]
    assert (m.num_used, m.num_free) == (3, 5)
    assert [m.ref_count[b] for b in table] == [1, 1, 1]


def test_two_tables_never_share_a_fresh_block():
    m = BlockManager(8, BS)
    a: list[int] = []
    b: list[int] = []
    m.grow(a, 2 * BS)
    m.grow(b, 3 * BS)
    assert not set(a) & set(b)
    assert m.num_used == 5


def test_can_grow_counts_only_the_blocks_still_missing():
    m = BlockManager(3, BS)
    table: list[int] = []
    assert m.can_grow(table, 3 * BS)
    assert not m.can_grow(table, 3 * BS + 1)
    m.grow(table, 2 * BS)
    assert m.can_grow(table, 3 * BS)  # needs one more block, one is free
    assert not m.can_grow(table, 3 * BS + 1)  # needs two more, one is free
    assert m.can_grow(table, BS)  # needs nothing


def test_grow_past_the_pool_raises_and_takes_nothing():
    m = BlockManager(3, BS)
    other: list[int] = []
    m.grow(other, BS)
    table: list[int] = []
    m.grow(table, BS)
    with pytest.raises(OutOfBlocks):
        m.grow(table, 3 * BS)  # needs two more, one is free
    assert table == [1]
    assert (m.num_used, m.num_free) == (2, 1)
    assert m.ref_count == [1, 1, 0]
    m.grow(table, 2 * BS)  # the block that was free is still there
    assert m.num_free == 0


# --- free and reference counts ----------------------------------------------------------------


def test_free_gives_the_blocks_back_and_empties_the_table():
    m = BlockManager(4, BS)
    table: list[int] = []
    m.grow(table, 3 * BS)
    m.free(table)
    assert table == []
    assert (m.num_used, m.num_free) == (0, 4)
    assert m.ref_count == [0] * 4
    again: list[int] = []
    m.grow(again, 4 * BS)  # the whole pool can be handed out again
    assert sorted(again) == [0, 1, 2, 3]


def test_a_block_freed_twice_is_caught():
    m = BlockManager(4, BS)
    table: list[int] = []
    m.grow(table, BS)
    stale = list(table)
    m.free(table)
    with pytest.raises(AssertionError):
        m.free(stale)


def test_a_shared_block_stays_used_until_its_last_holder_frees_it():
    m = BlockManager(8, BS)
    tokens = prompt(2 * BS + 1)
    first, _ = started(m, tokens)
    second, hit = started(m, tokens)
    shared = first[:2]
    assert hit == 2 * BS and second[:2] == shared
    assert [m.ref_count[b] for b in shared] == [2, 2]
    used = m.num_used
    m.free(first)
    assert [m.ref_count[b] for b in shared] == [1, 1]
    assert m.num_used == used - 1  # only first's own last block came back
    assert not set(shared) & set(free_blocks(m))
    m.free(second)
    assert [m.ref_count[b] for b in shared] == [0, 0]
    assert m.num_used == 0 and m.num_free == 8


# --- prefix caching ---------------------------------------------------------------------------


def test_a_second_sequence_with_the_same_prefix_takes_the_same_blocks():
    m = BlockManager(16, BS)
    system = prompt(3 * BS)
    first, hit = started(m, system + [1, 2])
    assert hit == 0  # nothing cached yet
    assert m.num_cached == 3  # the three full blocks; the partial one is not named
    table: list[int] = []
    assert m.take_prefix(table, system + [7, 8, 9]) == 3 * BS
    assert table == first[:3]


def test_the_cache_outlives_the_sequence_that_filled_it():
    m = BlockManager(16, BS)
    tokens = prompt(2 * BS + 1)
    first, _ = started(m, tokens)
    blocks = first[:2]
    m.free(first)
    assert m.num_cached == 2 and m.num_free == 16  # parked: free, but still named
    table: list[int] = []
    assert m.take_prefix(table, tokens) == 2 * BS
    assert table == blocks
    assert m.num_used == 2 and [m.ref_count[b] for b in blocks] == [1, 1]


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_different_token_in_block_k_leaves_only_the_blocks_before_it(k):
    m = BlockManager(16, BS)
    tokens = prompt(4 * BS + 1)
    first, _ = started(m, tokens)
    changed = list(tokens)
    changed[k * BS + BS - 1] = -1  # the last token of block k
    table: list[int] = []
    assert m.take_prefix(table, changed) == k * BS
    assert table == first[:k]


def test_a_changed_earlier_block_breaks_the_chain_even_if_later_blocks_match():
    m = BlockManager(16, BS)
    tokens = prompt(3 * BS + 1)
    started(m, tokens)
    changed = [-1] + tokens[1:]  # blocks 1 and 2 hold the same tokens, after a different prefix
    table: list[int] = []
    assert m.take_prefix(table, changed) == 0
    assert table == []


@pytest.mark.parametrize("n_tokens, hit_blocks", [(BS, 0), (BS + 1, 1), (2 * BS, 1), (2 * BS + 1, 2)])
def test_the_last_token_is_never_served_from_the_cache(n_tokens, hit_blocks):
    m = BlockManager(16, BS)
    tokens = prompt(3 * BS)
    started(m, tokens)  # all three blocks cached
    table: list[int] = []
    assert m.take_prefix(table, tokens[:n_tokens]) == hit_blocks * BS
    assert len(table) == hit_blocks


def test_register_names_only_full_computed_blocks():
    m = BlockManager(16, BS)
    tokens = prompt(3 * BS)
    table: list[int] = []
    m.grow(table, len(tokens))
    m.register(table, tokens, BS + 2)  # block 1 is only half computed
    assert m.num_cached == 1
    m.register(table, tokens, 3 * BS)
    assert m.num_cached == 3
    m.register(table, tokens, 3 * BS)  # naming again changes nothing
    assert m.num_cached == 3


def test_a_prefix_computed_twice_keeps_the_first_copy_shared():
    m = BlockManager(16, BS)
    tokens = prompt(2 * BS + 1)
    first, second = [], []
    for table in (first, second):  # both start before either registers: both miss
        assert m.take_prefix(table, tokens) == 0
        m.grow(table, len(tokens))
    m.register(first, tokens, len(tokens))
    m.register(second, tokens, len(tokens))
    assert m.num_cached == 2
    third: list[int] = []
    assert m.take_prefix(third, tokens) == 2 * BS
    assert third == first[:2]
    m.free(second)  # its copies were never named: they go straight back to the free list
    assert not set(second) & set(m._parked)


def test_without_prefix_caching_nothing_is_ever_shared():
    m = BlockManager(16, BS, prefix_caching=False)
    tokens = prompt(3 * BS + 1)
    first, hit = started(m, tokens)
    assert hit == 0 and m.num_cached == 0
    second, hit = started(m, tokens)
    assert hit == 0
    assert not set(first) & set(second)
    m.free(first)
    third, hit = started(m, tokens)
    assert hit == 0


def test_hit_rate_counts_admitted_tokens():
    m = BlockManager(16, BS)
    assert (m.queried_tokens, m.hit_tokens, m.hit_rate) == (0, 0, 0.0)  # no division by zero
    tokens = prompt(2 * BS + 1)
    _, hit = started(m, tokens)
    m.count_lookup(len(tokens), hit)
    _, hit = started(m, tokens)
    m.count_lookup(len(tokens), hit)
    assert m.queried_tokens == 2 * len(tokens)
    assert m.hit_tokens == 2 * BS
    assert m.hit_rate == pytest.approx(2 * BS / (2 * len(tokens)))


# --- hash collisions --------------------------------------------------------------------------


def test_a_forced_hash_collision_is_a_miss_not_a_wrong_block(monkeypatch):
    monkeypatch.setattr(block_manager, "block_hash", lambda previous, tokens: 7)  # every block collides
    m = BlockManager(16, BS)
    tokens = prompt(BS + 1)
    first, _ = started(m, tokens)
    other: list[int] = []
    assert m.take_prefix(other, prompt(BS + 1, start=500)) == 0  # same hash, different tokens
    assert other == []
    same: list[int] = []
    assert m.take_prefix(same, tokens) == BS  # same hash, same tokens: still a hit
    assert same == first[:1]


def test_a_collision_does_not_chain_a_later_block_onto_the_wrong_prefix(monkeypatch):
    # Only a first block's hash collides here. Block 1 of B gets an honest name, but it is chained
    # to the colliding name of B's block 0, so a prompt that starts like A reaches it after A's
    # block 0, and B's K/V (computed after B's first tokens) would be served as A's.
    real = block_manager.block_hash
    monkeypatch.setattr(
        block_manager, "block_hash", lambda previous, tokens: 7 if previous is None else real(previous, tokens)
    )
    m = BlockManager(16, BS)
    a = prompt(BS, start=100)  # block 0 of sequence A
    b = prompt(BS, start=200)  # block 0 of sequence B: the same hash as A's, other tokens
    tail = prompt(BS, start=300)
    started(m, a)
    b_table, _ = started(m, b + tail)  # B's block 1 holds `tail`, computed after `b`
    table: list[int] = []
    hit = m.take_prefix(table, a + tail + [1])
    assert b_table[1] not in table
    assert hit == BS  # A's block 0 is a true hit; nothing after it is


# --- eviction ---------------------------------------------------------------------------------


def test_parked_blocks_are_reused_only_when_no_free_block_is_left():
    m = BlockManager(4, BS)
    tokens = prompt(2 * BS)
    first, _ = started(m, tokens)
    m.free(first)
    parked = set(first)
    other: list[int] = []
    m.grow(other, 2 * BS)
    assert not set(other) & parked  # the two uncached free blocks go first
    assert m.num_cached == 2
    table: list[int] = []
    assert m.take_prefix(table, tokens) == BS  # block 0 of the prefix still hits (the last token is left out)


def test_eviction_takes_the_least_recently_used_block_and_it_no_longer_hits():
    m = BlockManager(2, BS)
    p, q = prompt(BS, start=100), prompt(BS, start=200)  # one full block each, the whole pool
    table_p, _ = started(m, p)
    table_q, _ = started(m, q)
    block_p, block_q = table_p[0], table_q[0]
    m.free(table_p)
    m.free(table_q)
    assert list(m._parked) == [block_p, block_q] and not m._free
    touch: list[int] = []
    assert m.take_prefix(touch, p + [1]) == BS  # p is used again: q is now the least recent
    m.free(touch)
    assert list(m._parked) == [block_q, block_p]

    new: list[int] = []
    m.grow(new, BS)
    assert new == [block_q]
    assert m.num_cached == 1
    miss: list[int] = []
    assert m.take_prefix(miss, q + [1]) == 0  # q's block is gone from the cache
    hit: list[int] = []
    assert m.take_prefix(hit, p + [1]) == BS  # p's is still there
    assert hit == [block_p]


def test_a_freed_prefix_is_evicted_from_its_end():
    m = BlockManager(3, BS)
    tokens = prompt(3 * BS)
    first, _ = started(m, tokens)
    blocks = list(first)
    m.free(first)  # parks the last block first: the end of the prefix is the least recent
    table: list[int] = []
    m.grow(table, BS)
    assert table == [blocks[2]]
    m.free(table)
    again: list[int] = []
    assert m.take_prefix(again, tokens) == 2 * BS  # the start of the prefix survived
    assert again == blocks[:2]


def test_a_block_in_use_is_never_evicted():
    m = BlockManager(3, BS)
    tokens = prompt(2 * BS + 1)
    started(m, tokens)  # all three blocks used, two of them cached
    assert m.num_free == 0
    with pytest.raises(OutOfBlocks):
        m.grow([], BS)
    assert m.num_cached == 2


# --- fork -------------------------------------------------------------------------------------


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    m = BlockManager(8, BS)
    parent: list[int] = []
    m.grow(parent, 2 * BS + 1)
    child, copy = m.fork(parent, 2 * BS + 1)
    assert child[:2] == parent[:2]
    assert [m.ref_count[b] for b in parent[:2]] == [2, 2]
    src, dst = copy
    assert src == parent[2]
    assert child[2] == dst and dst not in parent
    assert m.ref_count[src] == 1 and m.ref_count[dst] == 1
    assert m.num_used == 4


def test_fork_on_a_block_boundary_copies_nothing():
    m = BlockManager(8, BS)
    parent: list[int] = []
    m.grow(parent, 2 * BS + 1)
    child, copy = m.fork(parent, 2 * BS)
    assert copy is None
    assert child == parent[:2]
    assert m.num_used == 3  # no block taken


def test_fork_needs_a_free_block_for_the_copy():
    m = BlockManager(2, BS)
    parent: list[int] = []
    m.grow(parent, BS + 1)  # the whole pool
    with pytest.raises(OutOfBlocks):
        m.fork(parent, BS + 1)
    assert m.ref_count == [1, 1]  # nothing taken, nothing shared
    child, copy = m.fork(parent, BS)  # on a block boundary: no copy, so it fits
    assert copy is None and child == parent[:1]


def test_forked_blocks_come_back_when_both_sides_free():
    m = BlockManager(8, BS)
    parent: list[int] = []
    m.grow(parent, 2 * BS + 1)
    child, _ = m.fork(parent, 2 * BS + 1)
    m.free(parent)
    assert m.num_used == 3  # the child's two shared blocks and its copy
    m.free(child)
    assert m.num_used == 0 and m.ref_count == [0] * 8


# --- random operations ------------------------------------------------------------------------


def check_books(m: BlockManager, live: list["Seq"]) -> None:
    """The invariants every call must keep."""
    assert m.num_used + m.num_free == m.num_blocks
    holders = [0] * m.num_blocks
    for seq in live:
        for block in seq.table:
            holders[block] += 1
    assert m.ref_count == holders
    free = free_blocks(m)
    assert len(free) == len(set(free)), "a block is free twice"
    assert not {b for seq in live for b in seq.table} & set(free), "a block is both held and free"
    assert all(m.ref_count[b] == 0 for b in m._parked)
    assert all(b in m._cached for b in m._parked), "a parked block must be a cached one"
    assert {m._by_hash[e.hash] for e in m._cached.values()} == set(m._cached)


class Seq:
    """A sequence of the random test: its table, tokens, and how many of them are computed."""

    def __init__(self, tokens: list[int], table: list[int], n_computed: int):
        self.tokens, self.table, self.n_computed = tokens, table, n_computed


def compute(m: BlockManager, kv: dict[int, list], seq: Seq) -> None:
    """'Runs the model' over seq's uncomputed tokens: the K/V at position t stands for all tokens up
    to t, so a block served from the cache can be checked against the prompt that takes it."""
    for t in range(seq.n_computed, len(seq.tokens)):
        block = seq.table[t // m.block_size]
        assert m.ref_count[block] == 1 and block not in m._cached, "writing into a shared or cached block"
        kv.setdefault(block, [None] * m.block_size)[t % m.block_size] = tuple(seq.tokens[: t + 1])
    seq.n_computed = len(seq.tokens)


@pytest.mark.parametrize("colliding", [False, True], ids=["real-hash", "colliding-hash"])
def test_random_operations_keep_the_books(colliding, monkeypatch):
    hypothesis = pytest.importorskip("hypothesis")
    st = pytest.importorskip("hypothesis.strategies")
    if colliding:  # few names for many blocks: collisions everywhere
        real = block_manager.block_hash
        monkeypatch.setattr(block_manager, "block_hash", lambda previous, tokens: real(previous, tokens) % 3)

    which = st.integers(0, 7)  # a live sequence, modulo how many there are
    register = st.booleans()  # name the full blocks once computed (or not: then they go back unnamed)
    start = st.tuples(st.just("start"), st.lists(st.integers(0, 1), min_size=1, max_size=8), register)
    operation = st.one_of(
        start,
        start,  # twice as likely as the others: more sequences, more shared prefixes
        st.tuples(st.just("step"), which, st.integers(0, 1), register),
        st.tuples(st.just("fork"), which),
        st.tuples(st.just("free"), which),
    )

    @hypothesis.settings(max_examples=200, deadline=None, database=None)
    @hypothesis.given(
        num_blocks=st.integers(1, 10),
        block_size=st.integers(1, 3),
        caching=st.booleans(),
        operations=st.lists(operation, min_size=10, max_size=50),
    )
    def run(num_blocks, block_size, caching, operations):
        m = BlockManager(num_blocks, block_size, prefix_caching=caching)
        live: list[Seq] = []
        kv: dict[int, list] = {}  # block -> what each slot's K/V stands for
        for op, *args in operations:
            if op == "start":
                tokens = args[0]
                table: list[int] = []
                hit = m.take_prefix(table, tokens)
                assert hit == len(table) * block_size and hit < len(tokens)
                assert caching or hit == 0
                for i, block in enumerate(table):  # a hit holds exactly this prompt's prefix
                    assert m._cached[block].tokens == tuple(tokens[i * block_size : (i + 1) * block_size])
                    # and what came before it too, even when every hash collides
                    assert kv[block] == [tuple(tokens[: i * block_size + j + 1]) for j in range(block_size)]
                if m.can_grow(table, len(tokens)):
                    m.grow(table, len(tokens))
                    seq = Seq(list(tokens), table, hit)
                    compute(m, kv, seq)
                    if args[1]:
                        m.register(seq.table, seq.tokens, seq.n_computed)
                    live.append(seq)
                else:
                    with pytest.raises(OutOfBlocks):
                        m.grow(table, len(tokens))
                    m.free(table)  # not now: give back the prefix it took
            elif not live:
                continue
            elif op == "step":
                seq = live[args[0] % len(live)]
                if m.can_grow(seq.table, len(seq.tokens) + 1):
                    seq.tokens.append(args[1])
                    m.grow(seq.table, len(seq.tokens))
                    compute(m, kv, seq)
                if args[2]:
                    m.register(seq.table, seq.tokens, seq.n_computed)
            elif op == "fork":
                parent = live[args[0] % len(live)]
                n = parent.n_computed
                if n % block_size and not m.num_free:
                    before = list(m.ref_count)
                    with pytest.raises(OutOfBlocks):
                        m.fork(parent.table, n)
                    assert m.ref_count == before
                else:
                    table, copy = m.fork(parent.table, n)
                    assert len(table) == m.blocks_for(n)
                    if copy is not None:
                        src, dst = copy
                        assert src == parent.table[n // block_size] and table[-1] == dst
                        kv[dst] = list(kv[src])
                    live.append(Seq(parent.tokens[:n], table, n))
            elif op == "free":
                seq = live.pop(args[0] % len(live))
                m.free(seq.table)
                assert seq.table == []
            check_books(m, live)
        for seq in live:
            m.free(seq.table)
        check_books(m, [])
        assert m.num_free == num_blocks

    run()
