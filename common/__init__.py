"""The bottom package: what every part uses and none owns. It imports nothing of this project.

- `validation`: the one validation layer (typed checks, one-line errors naming the key).
- `process_exit`: a command-line process's end once its output is written, without the interpreter's teardown.
"""
