"""Reference outputs from vLLM's own offline API, `vllm.LLM.generate`, in a separate process.

Two engines in one process would share vLLM's process-wide state (torch.distributed, the
worker-side KV connector), so the tests run this script as a subprocess:

    python tests/vllm/llm_reference.py REQUEST_JSON

REQUEST_JSON: {"engine": {EngineArgs keywords}, "prompts": [[token ids], ...],
               "sampling": {SamplingParams keywords}}
Prints, among vLLM's logs, one line "REFERENCE-TOKEN-IDS [[generated token ids], ...]", one list
per prompt.
"""

from __future__ import annotations

import json
import sys


def generate(request: dict) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**request["engine"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in request["prompts"]]
    outputs = llm.generate(prompts, SamplingParams(**request["sampling"]), use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


if __name__ == "__main__":  # vLLM may spawn its engine core: the guard is required
    result = generate(json.loads(sys.argv[1]))
    print("\nREFERENCE-TOKEN-IDS " + json.dumps(result), flush=True)
