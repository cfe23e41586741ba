"""How the CLI reports bad input: one ``error:`` line naming the fix, exit status 2 (``KVT_DEBUG=1``: traceback)."""
from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["USER_ERROR_EXIT", "INTERRUPTED_EXIT", "TERMINATED_EXIT", "UsageError", "console", "fail", "guard"]

USER_ERROR_EXIT = 2


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def console(stderr: bool = False):
    """The CLI's rich console (:func:`kvtransform.utils.console`: no wrapping at 80 columns when redirected)."""
    from ..utils import console as make_console

    return make_console(stderr=stderr)


def fail(message: str) -> "NoReturn":  # noqa: F821
    from rich.markup import escape

    console(stderr=True).print(f"[bold red]error:[/bold red] {escape(message)}", soft_wrap=True)
    raise SystemExit(USER_ERROR_EXIT)


def _is_user_error(e: BaseException) -> bool:
    """Errors caused by input (printed as one line) vs. bugs (traceback)."""
    if isinstance(e, (UsageError, ValueError, OSError, KeyError, NotImplementedError)):
        return True
    mod = type(e).__module__ or ""
    return mod.startswith(("kvtransform", "hydra", "omegaconf")) or "Verification" in type(e).__name__


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    text = str(e).strip() or type(e).__name__
    from ..capture import CaptureError

    if isinstance(e, (UsageError, ValueError, OSError, NotImplementedError, CaptureError)):
        return text
    if (type(e).__module__ or "").startswith(("hydra", "omegaconf")):  # no internal class names (ConfigComposition...)
        from hydra.errors import OverrideParseException

        first = text.splitlines()[0]
        return f"bad override syntax: {first}" if isinstance(e, OverrideParseException) else first
    return f"{type(e).__name__}: {text}"


INTERRUPTED_EXIT = 130  # the shell's status for a process stopped by Ctrl-C (128 + SIGINT)
TERMINATED_EXIT = 143  # 128 + SIGTERM


class _Terminated(BaseException):
    """SIGTERM arrived (a scheduler's or ``timeout``'s stop)."""


@contextlib.contextmanager
def _sigterm_unwinds():
    """While a command runs, SIGTERM raises :class:`_Terminated` in the main thread instead of ending the process on
    the spot, so what the command holds is cleaned up: ``finally`` blocks remove staging directories, and
    ``subprocess.run`` kills its child (the reload check's fresh Python process) rather than leaving it running.
    A handler someone else installed is left alone."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # cleanup runs once; a second SIGTERM ends the process
        raise _Terminated()

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def guard(fn, *args, **kwargs):
    """Run ``fn``; a user error becomes one ``error:`` line and exit status 2, Ctrl-C one ``interrupted`` line and
    exit status 130, SIGTERM one ``terminated`` line and exit status 143 after cleaning up (``KVT_DEBUG=1``:
    re-raise)."""
    try:
        with _sigterm_unwinds():
            return fn(*args, **kwargs)
    except SystemExit:
        raise
    except _Terminated:
        console(stderr=True).print("[bold red]terminated[/bold red] (SIGTERM)", soft_wrap=True)
        raise SystemExit(TERMINATED_EXIT) from None
    except KeyboardInterrupt:
        if os.environ.get("KVT_DEBUG"):
            raise
        console(stderr=True).print("[bold red]interrupted[/bold red] (Ctrl-C)", soft_wrap=True)
        raise SystemExit(INTERRUPTED_EXIT) from None
    except Exception as e:
        if os.environ.get("KVT_DEBUG") or not _is_user_error(e):
            raise
        fail(_message(e))
