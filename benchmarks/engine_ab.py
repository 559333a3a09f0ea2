"""A/B of the bundled model through qtk's engine, for a change's before and after: run it from each
checkout (the qtk of the current directory is imported), one after the other on an idle machine.

    cd CHECKOUT && python benchmarks/engine_ab.py [MODEL]

MODEL: the bundled model (default) or a checkpoint of it (`qtk quantize` output). float32 runtime, greedy, EOS ignored. Prints JSON: perplexity (4 x 1024-token windows of the
built-in evaluation text), batch-64 throughput (64 short chat prompts x 128 tokens), batch-1
decode (one chat prompt, 256 tokens)."""
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())

from qtk import LLM, SamplingParams  # noqa: E402
from qtk.chat_template import prompt_ids  # noqa: E402
from qtk.evals.perplexity import engine_perplexity, eval_windows  # noqa: E402


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
    llm = LLM(model, dtype="float32")
    tok = llm.tokenizer
    ppl = engine_perplexity(llm, eval_windows(tok, "builtin", 1024, 4), batch_size=4, progress=False).ppl
    prompts = [prompt_ids(tok, [{"role": "user", "content": f"Write a short story about a robot number {i}."}])
               for i in range(64)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    batch64 = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate([prompts[0]], SamplingParams(max_tokens=256, temperature=0, ignore_eos=True))
    batch1 = 256 / (time.perf_counter() - t)
    print(json.dumps({"tree": os.getcwd(), "model": model,
                      "ppl": ppl, "batch64_tok_s": round(batch64, 1),
                      "batch1_tok_s": round(batch1, 1)}))


if __name__ == "__main__":
    main()
