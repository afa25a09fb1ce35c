"""Engine launch lines read as their engines read them: ``tailserve lint`` (what each flag does in
a named engine version, the ones that do nothing, the ones that conflict, each with its source)
and ``tailserve simulate --engine-cmd`` (the line as a policy spec and a deployment).

``command.py`` reads a line; ``vllm_flags.py``, ``sglang_flags.py``, ``trtllm_flags.py`` hold each
supported version's table (``flag_spec.py``: rows and rules) and ``known/`` every option its
parser takes; ``options_file.py`` reads a file of options a flag names (``trtllm-serve --config
FILE``, its keys' table in ``trtllm_options.py``); ``lint.py`` gives the verdicts;
``translate.py`` maps them onto tailserve's policy flags, which are the engines' own names.
"""
