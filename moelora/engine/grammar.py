"""Grammar-constrained decoding with xgrammar: compiled grammars (once per distinct spec), each
constrained request's matcher, and the token bitmask of a step's constrained rows.

Compiling is the slow part, host work that grows with the spec: the server compiles
in its worker pool before a request reaches the engine thread, the offline LLM when it adds a
request; never on the device, never inside a CUDA graph. Filling a row's bitmask is host work
of O(vocabulary / 32) words per constrained request and step; the step's forward runs on the
device meanwhile (Engine._step).

JSON is compiled without free whitespace (separators as json.dumps writes them): a model, and
above all a random one, could otherwise emit whitespace until max_tokens.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable

import torch
import xgrammar as xgr

from moelora.errors import InvalidRequestError
from moelora.runner.sampler import TokenMask
from moelora.sampling_params import StructuredOutputsParams
from moelora.tokenizer import Tokenizer

_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice",
    "grammar": "EBNF grammar",
}
# xgrammar prefixes its errors with a time and its C++ source line: the user needs neither
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_CACHED = 1024  # distinct specs kept compiled; the oldest go first


class Grammars:
    """Compiles structured-output specs for one tokenizer and model vocabulary, and caches them
    by spec. Thread-safe: the server's workers compile while the engine thread makes matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int]):
        self.vocab_size = vocab_size  # the lm_head's rows: the bitmask covers them all
        self._tokenizer = tokenizer
        self._stop_ids = sorted(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None  # built on the first spec
        self._cache: dict[tuple[str, str], xgr.CompiledGrammar] = {}
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The spec's compiled grammar, from the cache when it was compiled before; an invalid
        spec is an InvalidRequestError that names the field and xgrammar's reason."""
        key = spec.key
        with self._lock:
            found = self._cache.get(key)
            compiler = self._compiler = self._compiler or self._new_compiler()
        if found is not None:
            return found
        try:
            compiled = _compile(compiler, spec)
        except (RuntimeError, ValueError, TypeError) as e:
            reason = _CPP_PREFIX.sub("", str(e).strip()).splitlines()[0][:300]
            raise InvalidRequestError(
                f"structured_outputs.{spec.kind} is not a valid {_WHAT[spec.kind]}: {reason}"
            ) from None
        with self._lock:
            if len(self._cache) >= _MAX_CACHED:
                del self._cache[next(iter(self._cache))]
            self._cache[key] = compiled
        return compiled

    def _new_compiler(self) -> xgr.GrammarCompiler:
        info = xgr.TokenizerInfo.from_huggingface(
            self._tokenizer.hf_tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids
        )
        # xgrammar's own cache is keyed by the text it compiles; ours is keyed by the spec
        return xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def matcher(self, compiled: xgr.CompiledGrammar) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(compiled, override_stop_tokens=self._stop_ids))

    def token_mask(self, rows: list[int], states: list[GrammarState]) -> TokenMask:
        """The bitmask of a step's constrained rows (rows[i] of the step's samples is states[i]'s
        request), on the host: pinned where a GPU will read it, so its copy does not block.
        Engine thread only."""
        words = xgr.get_bitmask_shape(len(rows), self.vocab_size)
        bitmask = torch.empty(words, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        live = [i for i, state in enumerate(states) if not state.terminated]
        if len(live) < len(states):  # their tokens are dropped: their requests have ended
            bitmask[[i for i in range(len(states)) if i not in set(live)]] = -1
        # one by one on the engine thread: xgrammar's BatchGrammarMatcher spreads the rows over
        # threads, which on a host of few cores slowed the server's steps, not sped them
        for i in live:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
        return TokenMask(bitmask, rows)


def _compile(compiler: xgr.GrammarCompiler, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind = spec.kind
    if kind == "json":
        schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        return compiler.compile_json_schema(schema, any_whitespace=False)
    if kind == "json_object":  # not strict: an object of any keys and values
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if kind == "regex":
        return compiler.compile_regex(spec.regex)
    if kind == "choice":
        literals = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice)
        return compiler.compile_grammar(f"root ::= {literals}")
    return compiler.compile_grammar(spec.grammar)


class GrammarState:
    """One constrained request's place in its grammar: advanced by each committed token."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> None:
        # the token was sampled under this grammar's own mask, so it is always accepted; a
        # refusal would mean the mask and the matcher went apart
        accepted = self.matcher.accept_token(token_id)
        assert accepted, f"token {token_id} refused by its own grammar"

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self.matcher.is_terminated()
