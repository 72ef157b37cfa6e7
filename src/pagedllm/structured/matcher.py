"""Compiled constraints and per-request matchers, over llguidance (no torch).

Owns: the tokenizer adapter (pagedllm's `Tokenizer` -> llguidance's
`LLTokenizer`, built once per tokenizer), the compile cache (an LRU of
compiled constraints per tokenizer, safe to fill from any thread), the
per-request `Matcher` (fill a bitmask row, advance by the sampled token, say
whether the output may or must end) and the batched fill. Does not own: the
constraint's validation (`constraint.py`) or putting the bitmask on the logits
(`bitmask.py`, torch).

Bitmask layout (llguidance's, xgrammar's and vLLM's): one int32 row per
request of `ceil(V / 32)` words, V the tokenizer's vocabulary; token t is
allowed when bit `t % 32` of word `t // 32` is set. Bits past V are zero.

Threads. llguidance's objects are Rust values behind PyO3, which checks each
borrow at run time: two threads that use one matcher at once get an error,
never a torn state. Building a matcher and filling a mask release the GIL.
So: compile on any thread (the cache serialises nothing but its dictionary);
use each `Matcher` from one thread at a time (the stepping thread: fill while
the GPU runs, advance after sampling). llguidance's own threads fill the rows
of a batch, and never call our tokenizer (`_prime_forced_tokens`). The
compiled template of a constraint is never advanced, only copied
(`LLMatcher.deep_copy`, about a microsecond).
A copy shares its template's lexer, behind a lock, so a constraint keeps one
independent template per filling thread (`CompiledConstraint`).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedllm.structured.constraint import StructuredOutput, one_line
from pagedllm.utils import deferred_interrupts

# Compiled constraints kept per tokenizer. An entry is the grammar's parser and
# lexer (kilobytes to a few MB for large schemas); 256 distinct schemas cover a
# server's working set of tools and response formats.
DEFAULT_CACHE_SIZE = 256
# Texts the tokenizer callback remembers (a few hundred per schema in use).
_TOKENIZE_MEMO_SIZE = 8192


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one request's bitmask row: ceil(vocab_size / 32)."""
    return (vocab_size + 31) // 32


class TokenizerAdapter:
    """llguidance's view of a pagedllm `Tokenizer`: each id's bytes, which ids
    are special (never part of a grammar's text), and the ids that end the
    output (the tokenizer's `eos_token_ids`: EOS and the end-of-turn tokens).

    Built once per tokenizer (`tokenizer_adapter`): llguidance builds a token
    trie over the vocabulary (0.1 s for SmolLM2's 49,152 ids, 0.35 s for
    Llama 3's 128,256, on a laptop-class CPU core).
    """

    def __init__(self, tokenizer: Any) -> None:
        import llguidance

        eos = list(tokenizer.eos_token_ids)
        if not eos:
            raise ValueError(
                f"the tokenizer from {tokenizer.source} has no end-of-sequence token, "
                "so a constrained output could never end: constrained decoding needs one"
            )
        self.vocab_size: int = tokenizer.vocab_size
        self.words: int = bitmask_words(self.vocab_size)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        # Byte-level BPE and SentencePiece alike: the bytes each id decodes to
        # ("▁" already a space, "<0x0A>" already the byte). Unused ids are b"".
        tokens = [tokenizer.token_bytes(i) for i in range(self.vocab_size)]
        tokenize = _Tokenize(tokenizer, tokens, eos)
        self.ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(tokenize), eos_token=eos)
        tokenize.fallback = self.ll.greedy_tokenize
        # Parse errors in matchers say which token broke the grammar, not the
        # parser's whole state (which would echo the schema into logs).
        self.limits = llguidance.LLParserLimits(verbose_errors=False)

    def __repr__(self) -> str:
        return f"TokenizerAdapter(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids})"


class _Tokenize:
    """What llguidance's `TokenizerWrapper` reads: the vocabulary's bytes, the
    special ids, EOS, and a text -> ids function. llguidance calls the
    function for a mask whose next bytes are forced (`{"name":"`), to allow
    only the tokens our BPE would write for them: in compact JSON about once
    per two tokens, 10-30 us each, holding the GIL (`fill_bitmask` makes these
    calls on its own thread: `_prime_forced_tokens`). Text only: raising on
    bytes makes the wrapper hand us `str`, which our encoder takes. It must
    never raise on text: an exception there is a panic in llguidance, which
    would put the request's matcher in its error state; should our encoder
    fail, llguidance's greedy longest-match tokenization answers instead.
    """

    def __init__(self, tokenizer: Any, tokens: list[bytes], eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokens
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer
        self.fallback: Any = None  # set once the LLTokenizer exists
        self._memo: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")
        # The texts repeat: a schema's forced keys and punctuation after one of a
        # few last tokens, in every request of that schema. A hit costs a dict
        # lookup instead of our BPE (10-30 us), and these calls run one after
        # another on the stepping thread before the parallel fill.
        ids = self._memo.get(text)
        if ids is not None:
            return ids
        try:
            ids = self._tokenizer.encode(text, allow_special=False)
        except Exception:  # llguidance's own greedy tokenization (in Rust) instead
            return self.fallback(text) if self.fallback is not None else []
        if len(self._memo) >= _TOKENIZE_MEMO_SIZE:
            self._memo.clear()  # a new working set (other schemas): start again
        self._memo[text] = ids
        return ids


_adapters: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_caches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def tokenizer_adapter(tokenizer: Any) -> TokenizerAdapter:
    """The tokenizer's adapter, built on first use and kept while the tokenizer lives."""
    with _registry_lock:
        adapter = _adapters.get(tokenizer)
    if adapter is None:
        adapter = TokenizerAdapter(tokenizer)  # outside the lock: 0.1-0.4 s
        with _registry_lock:
            adapter = _adapters.setdefault(tokenizer, adapter)
    return adapter


def constraint_cache(tokenizer: Any) -> ConstraintCache:
    """The tokenizer's compile cache (one per tokenizer, built on first use)."""
    with _registry_lock:
        cache = _caches.get(tokenizer)
    if cache is None:
        cache = ConstraintCache(tokenizer_adapter(tokenizer))
        with _registry_lock:
            cache = _caches.setdefault(tokenizer, cache)
    return cache


def fill_threads() -> int:
    """Threads that fill a batch's masks (`fill_bitmask`): 80 % of the cores this
    process may use, at most 32 (llguidance's own default)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(32, cores * 4 // 5))


class CompiledConstraint:
    """A constraint compiled against one tokenizer: llguidance's matcher in its
    start state, copied for each request (`matcher()`).

    A copy shares its template's lexer, behind one lock: the masks of all the
    copies of one template are computed one at a time, whatever the threads
    (on the H200's 16-core host, 64 rows took as long on 12 threads as on
    one). So a constraint keeps several independent templates (`add_copies`,
    one per filling thread; each compile is well under a millisecond once the
    first is done) and hands them out in turn: each template's requests
    share a lexer, the templates run in parallel.
    """

    __slots__ = ("constraint", "adapter", "_templates", "_handed_out")

    def __init__(self, constraint: StructuredOutput, adapter: TokenizerAdapter) -> None:
        self.constraint = constraint
        self.adapter = adapter
        self._templates = [self._compile()]
        self._handed_out = 0

    def _compile(self) -> Any:
        import llguidance

        template = llguidance.LLMatcher(
            self.adapter.ll, self.constraint.grammar, log_level=0, limits=self.adapter.limits
        )
        if template.is_error():
            # Grammars are checked without a tokenizer when the constraint is
            # built; what is left is what needs one (a token the vocabulary lacks).
            raise ValueError(
                f"{self.constraint!r} cannot be compiled for this tokenizer: "
                f"{one_line(template.get_error())}"
            )
        return template

    @property
    def num_templates(self) -> int:
        return len(self._templates)

    def add_copies(self, total: int) -> None:
        """Compile independent templates until there are `total` (the cache does,
        on its thread, once the first request may use the first)."""
        while len(self._templates) < total:
            self._templates.append(self._compile())  # one append: safe beside matcher()

    def matcher(self) -> Matcher:
        """A fresh matcher at the start of the output (a copy: about a microsecond),
        of the templates in turn."""
        templates = self._templates
        group = self._handed_out % len(templates)
        self._handed_out += 1
        return Matcher(templates[group].deep_copy(), self.adapter, self, group)


class ConstraintCache:
    """Compiled constraints for one tokenizer, least recently used dropped first.

    `get` compiles on the calling thread (a millisecond or a few for typical
    schemas, more for large ones); `submit` compiles on the cache's own worker
    thread and returns a Future, so that a new schema never stalls the
    stepping loop. Two threads asking for the same constraint share one
    compile. A constraint that fails to compile is remembered as failing (its
    ValueError is raised again), so a client that resends a bad schema costs
    nothing.
    """

    def __init__(
        self,
        adapter: TokenizerAdapter,
        max_size: int = DEFAULT_CACHE_SIZE,
        copies: int | None = None,
    ) -> None:
        if max_size < 1:
            raise ValueError(f"max_size must be at least 1, got {max_size}")
        self.adapter = adapter
        self.max_size = max_size
        # Independent templates per constraint (CompiledConstraint): one per filling thread.
        self.copies = fill_threads() if copies is None else max(1, copies)
        self._entries: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, constraint: StructuredOutput) -> CompiledConstraint:
        """The compiled constraint (compiling it here on a miss). ValueError if it cannot compile."""
        future, owner = self._claim(constraint)
        if owner:
            self._compile_into(constraint, future)
        return future.result()

    def submit(self, constraint: StructuredOutput) -> Future:
        """A Future of the compiled constraint, compiled off the calling thread on a miss
        (done at once on a hit). Its `result()` raises the ValueError of a bad constraint."""
        future, owner = self._claim(constraint)
        if owner:
            with self._lock:
                if self._pool is None:
                    workers = max(1, min(4, (os.cpu_count() or 2) // 2))
                    self._pool = ThreadPoolExecutor(workers, thread_name_prefix="pagedllm-grammar")
            self._pool.submit(self._compile_into, constraint, future)
        return future

    def matcher(self, constraint: StructuredOutput) -> Matcher:
        """A new request's matcher (compiling on a miss)."""
        return self.get(constraint).matcher()

    def _claim(self, constraint: StructuredOutput) -> tuple[Future, bool]:
        """The constraint's entry, and whether this caller must compile it."""
        if not isinstance(constraint, StructuredOutput):
            raise TypeError(f"expected a StructuredOutput, got {type(constraint).__name__}")
        with self._lock:
            future = self._entries.get(constraint)
            if future is not None:
                self._entries.move_to_end(constraint)
                self.hits += 1
                return future, False
            self.misses += 1
            future = Future()
            self._entries[constraint] = future
            while len(self._entries) > self.max_size:
                self._entries.popitem(last=False)
            return future, True

    def _compile_into(self, constraint: StructuredOutput, future: Future) -> None:
        try:
            compiled = CompiledConstraint(constraint, self.adapter)
        except BaseException as e:  # delivered to every waiter through the Future
            future.set_exception(e)
            return
        future.set_result(compiled)  # the first request need not wait for the copies
        try:
            compiled.add_copies(self.copies)
        except Exception:  # (the first compiled: these do too) it works with fewer
            pass

    def close(self) -> None:
        """Stop the compile thread (waiting for compiles in flight)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class Matcher:
    """One request's position in its constraint.

    Each step: `allowed(row)` fills the request's bitmask row for the next
    token (on the CPU, while the GPU computes the logits); after sampling,
    `advance(token_id)`. `can_end`: the output so far is complete, so EOS is
    among the allowed tokens. `is_finished`: nothing but EOS may follow (the
    constraint is fully matched, or the matcher is in its error state); the
    engine may end the request there. `error`: None, or why the request must
    end with an error (a token the constraint rejects: only possible if the
    sampled token ignored the mask). In the error state `allowed` allows EOS
    only, so a request that keeps stepping still ends.

    A matcher remembers the tokens it consumed, so that `fill_bitmask` can tell
    two matchers of one compiled constraint in the same state (the same tokens
    so far) and compute their mask once: every request of a schema starts with
    the same forced keys, and the first free token's mask (inside a bounded
    string, a millisecond or more at Llama 3's vocabulary) is the same for all.
    """

    __slots__ = ("_m", "adapter", "_error", "_origin", "_group", "_tokens", "_hashes")

    def __init__(
        self, ll_matcher: Any, adapter: TokenizerAdapter, origin: Any = None, group: int = 0
    ) -> None:
        self._m = ll_matcher
        self.adapter = adapter
        self._error: str | None = None
        # The compiled constraint it was copied from (None: never shares a mask) and
        # which of its templates (the copies of one share a lexer and its lock), the
        # tokens consumed, and a running hash of them (hashes[-1]: all of them).
        self._origin = origin
        self._group = group
        self._tokens: list[int] = []
        self._hashes: list[int] = [0]

    def allowed(self, row: Any) -> None:
        """Fill `row`, a contiguous int32 CPU array (a torch tensor or a numpy array)
        of exactly `bitmask_words(vocab_size)` words, with the allowed tokens."""
        ptr, nbytes = _row_pointer(row)
        if nbytes != self.adapter.words * 4:
            raise ValueError(
                f"a bitmask row for this tokenizer holds {self.adapter.words} int32 words, "
                f"got {nbytes // 4}"
            )
        if self._error is not None:
            _eos_only(row, self.adapter)
            return
        with deferred_interrupts():  # our tokenizer may run here: see fill_bitmask
            self._m.unsafe_compute_mask_ptr(ptr, nbytes)

    def advance(self, token_id: int) -> bool:
        """Consume the sampled token. False (and the error state) if the constraint rejects it."""
        if self._error is not None:
            return False
        if not 0 <= token_id < self.adapter.vocab_size:
            self._error = (
                f"token id {token_id} is outside the tokenizer's vocabulary "
                f"[0, {self.adapter.vocab_size})"
            )
            return False
        if self._m.consume_token(token_id):
            self._tokens.append(token_id)
            self._hashes.append(hash((self._hashes[-1], token_id)))
            return True
        self._error = one_line(self._m.get_error()) or f"token {token_id} broke the constraint"
        return False

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` advances (speculative decoding, preemption, a failed step)."""
        if not num_tokens:
            return
        if not self._m.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self._m.get_error()}")
        del self._tokens[-num_tokens:]
        del self._hashes[-num_tokens:]

    def _same_state(self, other: Matcher) -> bool:
        """Whether `other` is a copy of the same compiled constraint that consumed the
        same tokens (so it allows the same ones next). Both without errors."""
        return (
            self._origin is not None
            and self._origin is other._origin
            and self._hashes[-1] == other._hashes[-1]
            and self._tokens == other._tokens
        )

    @property
    def can_end(self) -> bool:
        return self._error is None and self._m.is_accepting()

    @property
    def is_finished(self) -> bool:
        return self._error is not None or self._m.is_stopped()

    @property
    def error(self) -> str | None:
        if self._error is None and self._m.is_error():
            self._error = one_line(self._m.get_error())
        return self._error


def advance_matchers(matchers: Sequence[Matcher], tokens: Sequence[int]) -> list[bool]:
    """`matchers[i].advance(tokens[i])` for each i: one step of a batch's matchers
    after its tokens reach the host. A consume is a few microseconds in Rust, so
    one loop on the calling thread is cheaper than llguidance's thread pool
    (`LLExecutor.consume_token_par`) at any batch a step holds."""
    if len(matchers) != len(tokens):
        raise ValueError(f"{len(matchers)} matchers but {len(tokens)} tokens")
    return [m.advance(t) for m, t in zip(matchers, tokens)]


def _row_pointer(row: Any) -> tuple[int, int]:
    """(address, size in bytes) of a contiguous int32 CPU row, torch or numpy."""
    if hasattr(row, "data_ptr"):  # torch, without importing it
        if row.dtype.itemsize != 4 or row.device.type != "cpu" or not row.is_contiguous():
            raise ValueError("a bitmask row must be a contiguous int32 tensor on the CPU")
        if str(row.dtype) != "torch.int32":
            raise ValueError(f"a bitmask row must be int32, got {row.dtype}")
        return row.data_ptr(), row.numel() * 4
    if str(getattr(row, "dtype", "")) != "int32" or not row.flags["C_CONTIGUOUS"]:
        raise ValueError("a bitmask row must be a contiguous int32 array")
    return row.ctypes.data, row.nbytes


def _eos_only(row: Any, adapter: TokenizerAdapter) -> None:
    row[:] = 0
    for t in adapter.eos_token_ids:
        word, bit = divmod(t, 32)
        # Bit 31 as an int32 is negative: write the word's value in two's complement.
        value = int(row[word]) | (1 << bit)
        row[word] = value - (1 << 32) if value >= 1 << 31 else value


_executor: Any = None
_executor_lock = threading.Lock()


def fill_bitmask(bitmask: Any, rows: Sequence[tuple[int, Matcher]]) -> None:
    """Fill the bitmask rows of several requests at once: `rows` pairs a row
    index of `bitmask` (a contiguous (batch, words) int32 CPU tensor or array)
    with that request's matcher. llguidance spreads the rows over its own
    threads (`fill_threads`) with the GIL released; rows not
    named are left as they are. Matchers in the same state (`Matcher._same_state`)
    are computed once and the row copied to the others."""
    if not rows:
        return
    ptr, nbytes = _row_pointer(bitmask)
    batch = bitmask.shape[0]
    words = rows[0][1].adapter.words
    row_bytes = words * 4
    if nbytes != batch * row_bytes:
        raise ValueError(
            f"the bitmask must be (batch, {words}) int32 words for this tokenizer, "
            f"got {tuple(bitmask.shape)}"
        )
    live: list[tuple[tuple[int, int], int, Any]] = []  # (its template, row, llguidance's)
    first: dict[tuple[int, int, int], tuple[int, Matcher]] = {}  # state -> its computed row
    copies: list[tuple[int, int]] = []  # (row, the row it copies)
    for i, m in rows:
        if not 0 <= i < batch:
            raise ValueError(f"bitmask row {i} is outside [0, {batch})")
        if m.adapter.words != words:
            raise ValueError("the matchers of one bitmask must share one tokenizer")
        if m._error is not None:
            m.allowed(bitmask[i])
            continue
        if m._origin is not None:
            key = (id(m._origin), len(m._tokens), m._hashes[-1])
            seen = first.get(key)
            if seen is None:
                first[key] = (i, m)
            elif seen[1]._same_state(m):
                copies.append((i, seen[0]))
                continue
        live.append(((id(m._origin), m._group), i, m._m))
    # Our tokenizer runs on this thread below. A Ctrl-C raised inside it would be a
    # panic in llguidance (the row's matcher broken, the interrupt lost), so it
    # waits until every row is made.
    with deferred_interrupts():
        if live:
            _compute_rows(live, ptr, row_bytes, batch)
        for i, j in copies:
            ctypes.memmove(ptr + i * row_bytes, ptr + j * row_bytes, row_bytes)


def _compute_rows(live: list, ptr: int, row_bytes: int, batch: int) -> None:
    """llguidance's masks of `live` rows ((its template, row, matcher)) into the buffer."""
    global _executor
    if len(live) == 1:
        _, i, m = live[0]
        m.unsafe_compute_mask_ptr(ptr + i * row_bytes, row_bytes)
        return
    # Forced text first, on this thread. Where a row's next bytes are forced
    # (`","age":`), llguidance turns them into tokens with our tokenizer, a call
    # into Python; from its own threads each such call makes a Python thread state
    # and waits for the GIL (measured: see _prime_forced_tokens).
    _prime_forced_tokens(live)
    with _executor_lock:
        if _executor is None:
            import llguidance

            _executor = llguidance.LLExecutor(fill_threads())
    # The executor's threads take runs of the list: rows of one template (one lexer
    # lock) together keep each thread on its own lock.
    live.sort(key=lambda x: x[0])
    _executor.unsafe_compute_mask_ptr([(m, i) for _, i, m in live], ptr, row_bytes, batch)


def _prime_forced_tokens(live: Sequence[tuple[Any, int, Any]]) -> None:
    """Have each row's forced tokens computed on the calling thread, before the
    parallel fill.

    `LLMatcher.compute_ff_tokens` tokenizes the row's forced bytes (our
    `_Tokenize`, re-entered on this thread with the GIL already held: a few
    microseconds through its memo) and the matcher keeps the answer until its
    next mask, which then takes it instead of calling back. Without this the
    calls come from llguidance's worker threads, which Python does not know:
    each makes a thread state and waits for the GIL. With compact JSON about
    35 of 64 rows call back each step; on the 2-core CPU machine that cost
    about 2 ms a step of light rows (`scripts/bench_fill.py` counts the calls
    off the calling thread). A stopped matcher's mask is EOS alone: skipped.
    Nothing else changes: the tokens are those the mask would have computed.
    The cost moves to this thread, serial: about 6 us a row (the forced bytes'
    parse as well as the call; 0.4 ms of a 64-row fill on that machine).
    """
    for _, _, m in live:
        if not m.is_stopped():
            m.compute_ff_tokens()
