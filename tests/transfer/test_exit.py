"""A process that used kvtier's copy threads exits cleanly: the kept copy workers
must not be woken while the interpreter finalizes (that aborted it with exit 134,
"terminate called without an active exception")."""

import subprocess
import sys


def test_a_process_that_used_the_copy_workers_exits_with_zero(tmp_path):
    # the default storage bench: 268 MB of pages through pools whose copies use the workers
    code = ("import sys; from kvtier.cli import main; "
            "sys.exit(main(['bench', 'storage', '--backends', 'file', '--repeat', '1', '--json', "
            f"'--dir', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr
