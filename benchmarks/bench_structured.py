"""Structured outputs: tokens/s of constrained decoding, with and without fast-forward,
against the same batch decoding unconstrained; and grammar compile time per schema.

One in-process engine per configuration (SmolLM2 by default), the same prompts (a batch of
``--batch`` requests at a time, each asked to fill in a record), the same ``--max-tokens``:

* ``free``: no grammar (``ignore_eos``, so every request generates ``--max-tokens``);
* ``constrained``: the schema with long fixed keys, one token per step (forced tokens too);
* ``fast-forward``: the same schema, forced tokens appended as one extend step.

Reported: output tokens/s (generated tokens ÷ wall time, best of ``--rounds``), engine steps,
and the ratios the issue asks for (constrained ÷ free at the same tokens per request,
fast-forward ÷ constrained). Both constrained runs must produce the same tokens (checked).
Then the compile time of five schemas (cold, first compile in a fresh compiler).

    python benchmarks/bench_structured.py
    python benchmarks/bench_structured.py --batch 8 --requests 16 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve import Engine, SamplingParams

LONG_KEYS = {
    "type": "object",
    "properties": {
        "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99999},
        "customer_full_legal_name": {"type": "string", "maxLength": 24},
        "customer_primary_email_address": {"type": "string", "maxLength": 32},
        "preferred_contact_method_for_notifications": {"enum": ["email", "phone", "post"]},
        "account_creation_date_in_iso_format": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "is_subscribed_to_the_monthly_newsletter": {"type": "boolean"},
        "total_number_of_completed_orders": {"type": "integer", "minimum": 0, "maximum": 1000},
    },
    "required": ["customer_identification_number", "customer_full_legal_name",
                 "customer_primary_email_address", "preferred_contact_method_for_notifications",
                 "account_creation_date_in_iso_format", "is_subscribed_to_the_monthly_newsletter",
                 "total_number_of_completed_orders"],
    "additionalProperties": False,
}

SCHEMAS = {
    "long-keys": LONG_KEYS,
    "nested": {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": {"type": "string"}, "address": {"type": "object", "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"]}}, "required": ["name", "address"]}}, "required": ["user"]},
    "array-of-enums": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 5},
    "numbers": {"type": "object", "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                                 "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"]},
    "optional-fields": {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"},
                                                         "c": {"type": "boolean"}}, "required": ["a"]},
}

NAMES = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov",
         "Donald Knuth", "Frances Allen", "John Backus", "Leslie Lamport", "Tony Hoare",
         "Ken Thompson", "Radia Perlman", "Dennis Ritchie", "Margaret Hamilton", "Niklaus Wirth",
         "Shafi Goldwasser"]


def prompts(engine: Engine, n: int) -> list[str]:
    out = []
    for i in range(n):
        msg = (f"Write the customer record of {NAMES[i % len(NAMES)]} (customer number {1000 + i}) "
               f"as JSON with these fields: {', '.join(LONG_KEYS['properties'])}.")
        out.append(engine.tokenizer.apply_chat_template([{"role": "user", "content": msg}]))
    return out


def run(engine: Engine, texts: list[str], params: list[SamplingParams], batch: int) -> tuple[float, int, list]:
    s0 = engine.stats()["steps"]
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(texts), batch):
        outs += engine.generate(texts[i:i + batch], params[i:i + batch])
    dt = time.perf_counter() - t0
    return dt, engine.stats()["steps"] - s0, outs


def forced_tokens(engine: Engine) -> int:
    return engine.stats()["grammar_forced_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    engines = {ff: Engine(args.model, kv_cache_tokens=32768, max_running_requests=args.batch,
                          grammar_fast_forward=ff, cache="none") for ff in (False, True)}
    texts = prompts(engines[True], args.requests)
    cons = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                           json_schema=LONG_KEYS) for i in range(args.requests)]
    # Warm up: kernels, the grammar cache, the tokenizer's vocabulary for llguidance.
    for eng in engines.values():
        eng.generate(texts[:2], cons[:2])

    best: dict[str, tuple[float, int, int]] = {}
    ref_tokens = None
    for _ in range(args.rounds):
        for name, eng, ff in (("constrained", engines[False], False), ("fast-forward", engines[True], True)):
            f0 = forced_tokens(eng)
            dt, steps, outs = run(eng, texts, cons, args.batch)
            forced_per_run = forced_tokens(eng) - f0
            toks = sum(len(o.token_ids) for o in outs)
            got = [o.token_ids for o in outs]
            if ref_tokens is None:
                ref_tokens = got
            assert got == ref_tokens, f"{name}: output differs from the other constrained run"
            if name not in best or toks / dt > best[name][1] / best[name][0]:
                best[name] = (dt, toks, steps)
        # Unconstrained, same tokens per request as the constrained outputs had.
        lens = [len(t) for t in ref_tokens]
        free = [SamplingParams(max_tokens=n, temperature=args.temperature, seed=i, ignore_eos=True)
                for i, n in enumerate(lens)]
        dt, steps, outs = run(engines[False], texts, free, args.batch)
        toks = sum(len(o.token_ids) for o in outs)
        if "free" not in best or toks / dt > best["free"][1] / best["free"][0]:
            best["free"] = (dt, toks, steps)

    valid = sum(1 for t in ref_tokens if _valid(engines[True].tokenizer.decode(t)))
    print(f"model {args.model}, batch {args.batch}, {args.requests} requests, temperature {args.temperature}, "
          f"torch threads {torch.get_num_threads()}; {valid}/{len(ref_tokens)} outputs parse as the schema")
    print(f"{'config':<14}{'tokens':>8}{'steps':>8}{'seconds':>10}{'tok/s':>10}")
    for name in ("free", "constrained", "fast-forward"):
        dt, toks, steps = best[name]
        print(f"{name:<14}{toks:>8}{steps:>8}{dt:>10.2f}{toks / dt:>10.1f}")
    rate = {k: v[1] / v[0] for k, v in best.items()}
    print(f"constrained / free: {rate['constrained'] / rate['free']:.3f}")
    print(f"fast-forward / constrained: {rate['fast-forward'] / rate['constrained']:.2f}x "
          f"({forced_per_run} of the {best['fast-forward'][1]} tokens of a run were forced)")

    from radixserve.grammar.compiler import GrammarCompiler
    from radixserve.grammar.spec import GrammarSpec, schema_text

    comp = GrammarCompiler(engines[True].tokenizer, engines[True].vocab_size)
    comp.ll_tokenizer  # built once per process, reported apart
    for name, schema in SCHEMAS.items():
        t0 = time.perf_counter()
        comp.compile(GrammarSpec("json_schema", schema_text(schema)))
        print(f"compile {name:<16} {1000 * (time.perf_counter() - t0):8.2f} ms")
    t0 = time.perf_counter()
    comp.compile(GrammarSpec("json_schema", schema_text(LONG_KEYS)))
    print(f"compile cached           {1000 * (time.perf_counter() - t0):8.3f} ms")


def _valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), LONG_KEYS)
        return True
    except Exception:
        return False


if __name__ == "__main__":
    main()
