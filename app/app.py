"""StrataApp: wires the chat, the composer, the dashboard and the engine link together."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from rich.text import Text
from textual import events
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.reactive import reactive
from textual.widgets import Input, TextArea

from app.chat_actions import (
    Resend,
    conversation_before,
    cut,
    edit_target,
    find_edited,
    last_prompt_index,
    prompt_index_of,
    put_back,
)
from app.commands import ChatCommands, FlagCommands, SettingsCommands, screenshot_dir
from app.config import ChatConfig
from app.draft import Draft
from app.engine_link import EngineLink, LocalLink
from app.outbox import Entry, Outbox
from app.prompt_history import PromptHistory
from app.remote_link import RemoteLink
from app.screens import ConversationsScreen, HelpScreen, LoadingScreen, OpenAt
from app.settings import DEFAULT_THEME, SettingsError, SettingsKeeper
from app.store import Store, StoreError, export_markdown
from app.widgets.base import EventView
from app.widgets.chat_log import ChatLog
from app.widgets.chat_settings import ChatSettings, ChatSettingsScreen
from app.widgets.chrome import StrataFooter, StrataHeader
from app.widgets.compact_strip import CompactStrip
from app.widgets.dashboard import Dashboard
from app.widgets.event_log import EventLog
from app.widgets.flags_panel import FlagsPanel
from app.widgets.prompt_input import Composer
from engine.config import EngineOptions, LoanFlags
from engine.errors import FlagError, StrataError
from engine.loan.forecast import LoanVerdict
from engine.request.conversation import Conversation, Message, Sampling
from engine.trace.events import Event, Loading, PrefillProgress, Ready, Token

NARROW_COLUMNS = 100  # below this a compact strip stands for the dashboard; F2 shows it above
NARROW_DASHBOARD_HEIGHT = "55%"  # of the screen below the header, when F2 shows it there
WHAT_IF_TOKENS = 4096  # the flags panel's what-if when the input holds no message
# an answer's text so far goes to the store this often while it streams (one short
# transaction): a kill -9 loses at most this much of what was shown
PARTIAL_SAVE_S = 0.5
RETRY_S = 5.0  # messages the store refused are tried again this often (and with each write)
# quit as Ctrl+Q does (the answer so far stored first) on these; SIGHUP: the terminal closed
QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def what_if_text(new: LoanVerdict, old: LoanVerdict, applied: bool) -> Text:
    """'next message' / 'if applied', a message's forecast under the new flags, and under
    the flags before when it differs."""
    head = "from the next message" if applied else "if applied"
    text = Text(f"{head}, a {new.fresh_tokens:,}-token message: ", style="dim")
    text.append(new.line(), style="bold")
    if old.line() != new.line():
        text.append(f"\n{'was' if applied else 'now'}: {old.line()}", style="dim")
    return text


class StrataApp(App[None]):
    """The chat app. Engine work runs in thread workers behind `EngineLink`."""

    TITLE = "strata chat"
    COMMANDS = App.COMMANDS | {FlagCommands, ChatCommands, SettingsCommands}
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel"),
        Binding("escape", "focus_input", "Back to the input", show=False),
        Binding("ctrl+n", "new_conversation", "New"),
        Binding("ctrl+o", "open_conversation", "Open"),
        Binding("ctrl+s", "export", "Export"),
        Binding("f2", "toggle_dashboard", "Dashboard"),
        Binding("f3", "flags", "Flags"),
        Binding("f1", "help", "Help"),
        Binding("ctrl+t", "change_theme", "Theme", show=False),
        Binding("f4", "chat_settings", "Sampling", show=False),
        Binding("ctrl+r", "regenerate", "Regenerate", show=False),
        Binding("ctrl+up", "focus_messages", "Messages", show=False),
    ]
    CSS = """
    #main { height: 1fr; }
    #chat-pane { width: 3fr; min-width: 40; }
    """

    running: reactive[bool] = reactive(False)
    show_dashboard: reactive[bool] = reactive(True)
    narrow: reactive[bool] = reactive(False)

    def __init__(
        self, config: ChatConfig, store: Store | None = None, export_dir: Path | None = None
    ):
        super().__init__()
        self.config = config
        self.link: EngineLink = (
            RemoteLink(self, config.connect, config.api_key) if config.connect
            else LocalLink(self, config.options, config.default_flags or config.flags)
        )  # fmt: skip
        # what new conversations take, the theme, the dashboard: kept in the settings file
        self.settings = SettingsKeeper(config.settings, config.settings_path,
                                       Sampling(config.params, config.max_new))
        self.store = store
        self.export_dir = export_dir
        self.conv = self._new_conversation()
        self.error_line = ""
        self._outbox: Outbox | None = None  # None until the store is open
        self._prompt: Entry | None = None  # the prompt being answered, and its answer so far
        self._answer: Entry | None = None
        self._resend: Resend | None = None  # the request sends a message again in its place
        self._quitting = False  # quitting: a late reply is no longer recorded
        self._signals: list[signal.Signals] = []
        # engine batches go to these many times a second: looked up once, not per batch
        self._chat = ChatLog()
        self._views: list[EventView | EventLog] = []

    def compose(self) -> ComposeResult:
        yield StrataHeader(icon="▦")
        with Horizontal(id="main"):
            with Vertical(id="chat-pane"):
                yield CompactStrip()
                yield self._chat
                yield Composer(self.link.count_tokens, self._ask)
            yield Dashboard()
        yield StrataFooter()

    def on_mount(self) -> None:
        self._views = [*self.query(EventView), *self.query(EventLog)]
        self._composer = self.query_one(Composer)
        self.push_screen(LoadingScreen(self.config.options.model, self.config.connect))
        if self.config.connect:  # until the server says which model it runs
            self.sub_title = f"remote: {self.config.connect}"
        self.query_one(FlagsPanel).show(self.config.flags, self.config.options)
        self._apply_settings()
        self._catch_signals()
        self.call_after_refresh(self._start)

    def _catch_signals(self) -> None:
        """SIGTERM and SIGHUP quit as Ctrl+Q does: the answer so far is stored first."""
        try:
            loop = asyncio.get_running_loop()
            for sig in QUIT_SIGNALS:
                loop.add_signal_handler(sig, self.call_later, self.action_quit)
                self._signals.append(sig)
        except (RuntimeError, ValueError, NotImplementedError):  # not the main thread
            pass

    async def _start(self) -> None:
        """After the first frame (the loading dialog): the engine loads in a worker while the
        last conversation is drawn (both took seconds before anything showed)."""
        self.link.start()
        try:
            self.store = self.store or Store.open()
            self.conv = self.store.last() or self._new_conversation()
        except StoreError as exc:
            self._fail(str(exc))
            return
        if self.store.moved_aside is not None:
            self.notify(
                f"{self.store.path.name} could not be read as a conversation database; it was "
                f"moved to {self.store.moved_aside} and a new one was started.",
                title="Conversations",
                severity="warning",
                timeout=20,
            )
        if self.store.read_only:
            self.notify(f"history is read-only: {self.store.read_only}; new messages are "
                        "not saved.", title="Conversations", severity="warning", timeout=20)
        else:
            self._outbox = Outbox(self.store)
            self.set_interval(PARTIAL_SAVE_S, self._save_partial, name="save-partial")
            self.set_interval(RETRY_S, self._retry_saves, name="retry-saves")
        await self._chat.show(self.conv)
        self.query_one(Composer).history = PromptHistory(self._past_prompts)
        self.query_one(Composer).input.focus()

    def on_unmount(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in self._signals:
            loop.remove_signal_handler(sig)
        self.link.close()
        outbox = self._outbox
        if outbox is not None and not outbox.flush() and outbox.n_waiting:
            self.error_line = f"{outbox.n_waiting} message(s) could not be saved: {outbox.error}"
        if self.store is not None:
            self.store.close()

    # -- layout ------------------------------------------------------------------------------
    def on_resize(self, event: events.Resize) -> None:
        # this handler runs before App's own, which is where `self.size` becomes the new size
        narrow = event.size.width < NARROW_COLUMNS
        if narrow != self.narrow:
            self.narrow = narrow
            self.show_dashboard = not narrow

    def watch_narrow(self) -> None:
        self._layout()

    def watch_show_dashboard(self) -> None:
        self._layout()

    def _layout(self) -> None:
        # Inline styles on the two widgets, not classes on #main: a class there restyled every
        # widget below it, the whole chat included (2.6 s of a resize during a prefill).
        dashboard, strip = self.query_one(Dashboard), self.query_one(CompactStrip)
        dashboard.display, strip.display = self.show_dashboard, not self.show_dashboard
        if self.narrow:  # over the chat, which keeps its last lines and the input below
            dashboard.styles.dock = "top"
            dashboard.styles.width = "1fr"
            dashboard.styles.height = NARROW_DASHBOARD_HEIGHT
        else:  # beside the chat: its own CSS
            for rule in ("dock", "width", "height"):
                dashboard.styles.clear_rule(rule)

    # -- engine ------------------------------------------------------------------------------
    async def on_engine_link_events(self, message: EngineLink.Events) -> None:
        await self._dispatch(message.events, message.streaming)

    async def _dispatch(self, events: tuple[Event, ...], streaming: bool = False,
                        at_once: bool = False) -> None:
        """Give `events` to the chat and the dashboard's views; `at_once`: the views apply
        them before this returns (a request's last batch: what the app shows once it is no
        longer running is the request's end), else in a message of their own."""
        chat = self._chat
        if not events or not chat.is_attached:  # nothing new, or the app is shutting down
            return
        text = "".join(e.text for e in events if isinstance(e, Token))
        if text:
            await chat.append(text)  # one append per drain, however many tokens
        for event in events:
            if isinstance(event, PrefillProgress):
                chat.progress(
                    f"reading the prompt: {event.tokens_done:,} of {event.tokens_total:,} tokens"
                )
            elif isinstance(event, Ready):
                self._show_model(event)
            elif isinstance(event, Loading) and isinstance(self.screen, LoadingScreen):
                self.screen.show(event)
        others = tuple(e for e in events if not isinstance(e, Token))
        if others:  # while decoding a batch is all tokens: the dashboard has nothing to draw
            for view in self._views:
                batch = EngineLink.Events(others, streaming)
                if at_once:
                    view.on_engine_link_events(batch)
                else:
                    view.post_message(batch)

    def _show_model(self, ready: Ready) -> None:
        """The header says what the model is (and where, when it is remote: the first part,
        kept when the header drops the rest to fit); the empty chat says what to try."""
        remote = f"remote: {self.config.connect} · " if self.config.connect else ""
        self.sub_title = (
            f"{remote}{ready.model_name} · {ready.n_layer} layers · {ready.n_expert} experts "
            f"({ready.n_expert_used} active) · vocab {ready.n_vocab:,}"
        )
        self._chat.welcome(ready.model_description)
        # the empty input keeps saying what to try after the welcome has scrolled away
        self.query_one(Composer).input.show_hint(ready.model_description)

    def on_engine_link_loaded(self, message: EngineLink.Loaded) -> None:
        loop = message.loop
        if isinstance(self.screen, LoadingScreen):
            self.pop_screen()
        self.query_one(Composer).input.focus()
        violations = self._startup_violations()
        if violations:
            self._fail("; ".join(violations))
            return
        self.query_one(FlagsPanel).show(loop.flags, loop.options)
        self.query_one(Composer).measure()

    def _startup_violations(self) -> list[str]:
        cfg = self.config
        if cfg.connect:
            return []  # a server's flags are its own
        if cfg.default_flags is not None:  # the engine started with them: now the file's
            refused = self.link.set_flags(cfg.flags, cfg.options)
            if not refused:
                return []
            self.notify(f"The loan flags in the settings are refused with these options "
                        f"({'; '.join(refused)}); the defaults apply.", title="Settings",
                        severity="warning", timeout=15)
            return self.link.set_flags(cfg.default_flags, cfg.options)
        if cfg.flags == LoanFlags() and not (cfg.options.mtp or cfg.options.spec):
            return []
        return self.link.set_flags(cfg.flags, cfg.options)

    def on_engine_link_load_failed(self, message: EngineLink.LoadFailed) -> None:
        self._fail(message.error)

    def _fail(self, line: str) -> None:
        self.error_line = line
        self.exit(return_code=2)

    # -- chat --------------------------------------------------------------------------------
    async def on_composer_send(self, message: Composer.Send) -> None:
        if not self._can_send():
            return
        resend = None
        if message.edit is not None:  # an edited message: sent in the place of the old one
            index = find_edited(self.conv, message.edit)
            if index is None:
                self.notify("The message being edited is no longer in this conversation; "
                            "Esc stops editing, or Enter again sends it as a new message.",
                            severity="warning", timeout=8)
                self.query_one(Composer).editing = None
                return
            resend = Resend(index, message.prompt, regenerate=False)
        self.query_one(Composer).clear()
        await self._send(message.prompt, message.draft, resend)

    def _can_send(self) -> bool:
        if self.link.loop is None:
            self.notify("The engine is still loading.", severity="warning")
            return False
        if self.running:
            self.notify("A request is running; Esc cancels it.", severity="warning")
            return False
        return True

    async def _send(self, prompt: str, draft: Draft, resend: Resend | None = None) -> None:
        """Send `prompt` in the open conversation; `resend`: in the place of the message at
        its index (it and what follows are cut first; the KV keeps the prefix before it)."""
        self.running = True
        if resend is None:
            await self._take_in_stored()
        else:  # (not what another window added: the positions cut are this window's)
            await self._cut(resend)
        # a conversation from before sampling was kept takes the defaults, stored with it
        sampling = self.conv.sampling = self.conv.sampling or self.settings.sampling
        # stored before the engine starts: a crash or kill during the request keeps the prompt
        self._prompt = Entry(self.conv, Message("user", prompt))
        self._answer = None
        self._save(lambda outbox: outbox.put(self._prompt))
        await self.query_one(ChatLog).begin_exchange(prompt)
        self.link.send(self.conv, prompt, draft, sampling.params, sampling.max_tokens)

    async def _cut(self, resend: Resend) -> None:
        """Drop the message at `resend.index` and every one after it: from the conversation,
        the log and the store (kept in `resend.dropped` until the new answer comes)."""
        resend.dropped = cut(self.conv, resend.index)
        self._resend = resend
        self._save(lambda outbox: outbox.cut(self.conv, resend.index))
        await self._chat.cut(resend.index)

    async def _put_back(self, draft: Draft, failed: bool = False) -> bool:
        """A resent message got no answer: the messages it replaced come back (the
        conversation, the log, the store); an edit goes back into the input, still an edit.
        False when the request was not a resend."""
        resend, self._resend = self._resend, None
        if resend is None:
            return False
        put_back(self.conv, resend.dropped)
        entries: list[Entry] = []
        for m in resend.dropped:  # stored again in order, each answer after its prompt
            prompt = next((e for e in reversed(entries) if e.message.role == "user"), None)
            entries.append(Entry(self.conv, m, reply_to=prompt if m.role != "user" else None))
        for entry in entries:
            self._save(lambda outbox, entry=entry: outbox.put(entry))
        await self._chat.show(self.conv)
        what = "the previous answer is back" if resend.regenerate else (
            "the conversation is as it was; your edit is back in the input")
        if not resend.regenerate:
            composer = self.query_one(Composer)
            composer.restore(draft)
            composer.editing = edit_target(self.conv, resend.index)
        if not failed:
            self.notify(f"Cancelled; {what}.")
        return True

    def _ask(self, text: str) -> LoanVerdict | None:
        """The composer's question (from its worker thread): what sending `text` in the open
        conversation would get."""
        editing = self._composer.editing  # (a worker thread: no DOM query)
        index = find_edited(self.conv, editing) if editing is not None else None
        conv = self.conv if index is None else conversation_before(self.conv, index)
        return self.link.preview(conv, text)

    async def on_engine_link_reply_done(self, message: EngineLink.ReplyDone) -> None:
        if self._quitting:  # the app quit mid-request; what it showed is stored already
            return
        # every token and event of this request, before closing it
        await self._dispatch(self.link.take(), at_once=True)
        chat, reply = self.query_one(ChatLog), message.reply
        if reply.withdrawn:  # cancelled before any text: the prompt goes back to the input
            self._withdraw(message.conversation)
            await chat.withdraw()
            if not await self._put_back(message.draft):
                self.query_one(Composer).restore(message.draft)
                self.notify("Cancelled; your prompt is back in the input.")
        else:
            self._resend = None
            self._keep_answer(message.conversation.messages[-1])
            await chat.finish(reply.text, cancelled=reply.cancelled)
            if reply.cancelled:
                self.notify("Cancelled; the answer so far is kept.", timeout=3)
            self.query_one(Composer).measure()  # the next message reuses this exchange
        self.running = False  # last: the exchange is stored and shown

    async def on_engine_link_reply_failed(self, message: EngineLink.ReplyFailed) -> None:
        if self._quitting:
            return
        await self._dispatch(self.link.take(), at_once=True)
        self._withdraw(message.conversation)
        await self.query_one(ChatLog).withdraw()
        if not await self._put_back(message.draft, failed=True):
            self.query_one(Composer).restore(message.draft)
        self.notify(message.error, title="Request failed", severity="error", timeout=10)
        self.running = False

    # -- store -------------------------------------------------------------------------------
    def _save(self, write: Callable[[Outbox], bool]) -> None:
        """One write through the outbox; say when messages start waiting in memory for the
        store (and how many), and when the ones that waited are written."""
        outbox = self._outbox
        if self._quitting or outbox is None:
            return
        before = outbox.n_waiting
        if write(outbox):
            if before:
                self.notify(f"The {before} message(s) that waited are saved.", title="Saved")
        elif outbox.n_waiting > before:
            self.notify(
                f"{outbox.n_waiting} message(s) wait in memory: {outbox.error}. They are "
                f"written when the database takes them (tried every {RETRY_S:.0f} s).",
                title="Not saved yet", severity="warning", timeout=10,
            )

    def _retry_saves(self) -> None:
        self._save(Outbox.flush)

    def _save_partial(self) -> None:
        """While an answer streams, its text so far into the store (a row marked partial)."""
        if not self.running or self._prompt is None:
            return
        text = self._chat.partial
        answer = self._answer
        if not text or answer is not None and answer.message.content == text:
            return
        if answer is None:
            answer = self._answer = Entry(self.conv, Message("assistant", text),
                                          reply_to=self._prompt, partial=True)
        else:
            answer.message = Message("assistant", text, answer.message.created)
        self._save(lambda outbox: outbox.put(answer))

    def _keep_answer(self, answer: Message) -> None:
        """Store the answer's final text (over its partial row, if one was written)."""
        entry = self._answer or Entry(self.conv, answer, reply_to=self._prompt)
        entry.message, entry.partial = answer, False
        self._prompt = self._answer = None
        self._save(lambda outbox: outbox.put(entry))

    def _withdraw(self, conv: Conversation) -> None:
        """Remove the stored prompt (and partial answer) of a request that ended without one."""
        entries = [e for e in (self._answer, self._prompt) if e is not None]
        self._prompt = self._answer = None
        for entry in entries:  # the answer first: its row names the prompt
            self._save(lambda outbox, entry=entry: outbox.withdraw(entry))

    def _store_failed(self, exc: StoreError, title: str = "Conversations") -> None:
        self.notify(str(exc), title=title, severity="error", timeout=10)

    async def _take_in_stored(self) -> None:
        """Show and include the messages another instance appended to this conversation."""
        assert self.store is not None
        try:
            stored = self.store.load(self.conv.id)
        except StoreError as exc:
            self._store_failed(exc)
            return
        if stored is None or len(stored.messages) <= len(self.conv.messages):
            return
        n_new = len(stored.messages) - len(self.conv.messages)
        self.conv = stored
        await self.query_one(ChatLog).show(stored)
        self.notify(f"{n_new} new message(s) from another window.", title="Conversations")

    async def _keep_partial(self) -> None:
        """Quitting mid-answer: store what the answer has shown, marked cancelled.

        The prompt stays stored even when no text came yet (the input goes away with the app).
        """
        chat = self.query_one(ChatLog)
        text = chat.partial
        if self._prompt is not None and text:
            self._keep_answer(Message("assistant", text, cancelled=True))
        self._quitting = True  # the late reply is neither recorded nor shown
        await chat.finish(text, cancelled=True)  # closes the stream

    def action_cancel(self) -> None:
        if self.running:
            self.link.cancel()
            self.notify("Cancelling…", timeout=2)
        self.action_focus_input()

    def action_focus_input(self) -> None:
        self.query_one(Composer).input.focus()

    # -- message actions (the log's focused message, ctrl+r, the palette) ---------------------
    def action_focus_messages(self) -> None:
        if not self._chat.focus_message():
            self.notify("No messages yet.", timeout=2)

    async def action_regenerate(self, index: int | None = None) -> None:
        """Answer again the prompt of the answer at `index` (default: the last prompt): it
        is sent again; it and every message after it are dropped first."""
        if not self._can_send():
            return
        at = last_prompt_index(self.conv) if index is None else prompt_index_of(self.conv, index)
        if at is None:
            self.notify("Nothing to regenerate yet.", severity="warning", timeout=3)
            return
        prompt = self.conv.messages[at].content
        await self._send(prompt, Draft(""), Resend(at, prompt, regenerate=True))

    def action_edit(self, index: int | None = None) -> None:
        """Put the prompt at `index` (an answer: its prompt; default: the last prompt) into
        the input, to send in its place."""
        if self._refuse_while_running():
            return
        at = last_prompt_index(self.conv) if index is None else prompt_index_of(self.conv, index)
        if at is None:
            self.notify("No message to edit yet.", severity="warning", timeout=3)
            return
        self.query_one(Composer).edit(edit_target(self.conv, at), self.conv.messages[at].content)

    def action_copy_last(self, code: bool = False) -> None:
        """Copy the last answer (`code`: its last code block) as its focused view would."""
        views = [v for v in self._chat.views if v.role == "assistant"]
        if not views:
            self.notify("No answer to copy yet.", severity="warning", timeout=3)
        elif code:
            views[-1].action_copy_code()
        else:
            views[-1].action_copy()

    async def on_chat_log_regenerate(self, message: ChatLog.Regenerate) -> None:
        await self.action_regenerate(message.index)

    def on_chat_log_edit(self, message: ChatLog.Edit) -> None:
        self.action_edit(message.index)

    def _past_prompts(self) -> list[str]:
        """The input's Up history: the stored prompts (none when the store cannot say)."""
        if self.store is None:
            return []
        try:
            return self.store.prompt_history()
        except StoreError as exc:
            self._store_failed(exc, "Prompt history")
            return []

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "cancel":
            return self.running or None  # None: shown greyed out in the footer
        if action == "focus_input":
            main = self.screen is self.screen_stack[0]
            return main and self.focused is not self.query_one(Composer).input
        if action in ("regenerate", "focus_messages"):  # not behind a dialog
            return self.screen is self.screen_stack[0]
        return True

    # -- typing anywhere goes to the prompt ----------------------------------------------------
    def _typing_elsewhere(self) -> bool:
        """The focus is on the main screen but not in a text field (a switch, a select)."""
        return self.screen is self.screen_stack[0] and not isinstance(
            self.focused, (Input, TextArea)
        )

    def on_key(self, event: events.Key) -> None:
        # runs before App's own handler, which tries the bindings: a bound key is left to them
        bound = event.key in self.active_bindings
        if event.is_printable and event.character and not bound and self._typing_elsewhere():
            event.prevent_default()
            prompt = self.query_one(Composer).input
            prompt.focus()
            prompt.insert(event.character)

    def on_paste(self, event: events.Paste) -> None:
        if self._typing_elsewhere():
            prompt = self.query_one(Composer).input
            prompt.focus()
            prompt.paste(event.text)

    def watch_running(self) -> None:
        self.refresh_bindings()

    # -- flags -------------------------------------------------------------------------------
    def flags_in_force(self) -> tuple[LoanFlags, EngineOptions] | None:
        loop = self.link.loop
        return (loop.flags, loop.options) if loop is not None else None

    def request_flags(self, flags: LoanFlags, options: EngineOptions) -> None:
        """Ask the engine for new flags/options (the flags panel and the command palette)."""
        panel = self.query_one(FlagsPanel)
        if self.link.loop is None:
            self.notify("The engine is still loading.", severity="warning")
            panel.refused(["the engine is still loading"])
            return
        before = (self.link.loop.flags, self.link.loop.options)
        violations = self.link.set_flags(flags, options)
        if violations:
            panel.refused(violations)
            panel.scroll_visible(top=True, animate=False)
            self.notify("\n".join(violations), title="Flags refused", severity="error", timeout=8)
            return
        panel.accepted(flags, options)
        self.notify("Applies from the next message.", title="Flags accepted")
        if not self.config.connect:  # a server's flags are its own
            self._keep(flags=flags)
        self.query_one(Composer).measure()  # what the message in the input gets now
        self._what_if(flags, options, before, applied=True)

    def on_flags_panel_requested(self, message: FlagsPanel.Requested) -> None:
        self.request_flags(message.flags, message.options)

    def on_flags_panel_what_if(self, message: FlagsPanel.WhatIf) -> None:
        loop = self.link.loop
        if loop is not None:
            self._what_if(message.flags, message.options, (loop.flags, loop.options),
                          applied=False)

    def _what_if(self, flags: LoanFlags, options: EngineOptions,
                 before: tuple[LoanFlags, EngineOptions], applied: bool) -> None:
        """The flags panel's what-if: the forecast of the message being written (else of a
        4,096-token one) under `flags` beside `before`, computed in a worker."""
        panel = self.query_one(FlagsPanel)
        verdict = self.query_one(Composer).verdict
        n = verdict.fresh_tokens if verdict is not None else WHAT_IF_TOKENS
        link = self.link

        def work() -> None:
            try:
                text = what_if_text(link.what_if(flags, options, n),
                                    link.what_if(*before, n), applied)
            except FlagError as e:
                text = Text("would be refused: " + "; ".join(e.violations), style="red")
            except StrataError as e:  # a remote engine that does not answer
                text = Text(f"no forecast: {e}", style="dim")
            self.call_from_thread(setattr, panel, "forecast", text)

        self.run_worker(work, thread=True, exclusive=True, group="what-if")

    # -- conversations -----------------------------------------------------------------------
    async def action_new_conversation(self) -> None:
        if self._refuse_while_running():
            return
        self.conv = self._new_conversation()
        await self.query_one(ChatLog).show(self.conv)
        self.query_one(Composer).measure()
        self.query_one(Dashboard).conversation_changed("new conversation")
        self.notify("New conversation.", timeout=2)

    def action_open_conversation(self) -> None:
        if self._refuse_while_running():
            return
        assert self.store is not None
        try:
            listed = self.store.list()
        except StoreError as exc:
            self._store_failed(exc)
            return
        self.push_screen(ConversationsScreen(listed, self.conv.id, self.store.search),
                         self._open)

    async def on_conversations_screen_deleted(self, message: ConversationsScreen.Deleted) -> None:
        assert self.store is not None
        try:
            self.store.delete(message.conv_id)
        except StoreError as exc:
            self._store_failed(exc)
            return
        if message.conv_id == self.conv.id:  # the open one: a new conversation takes its place
            self.conv = self._new_conversation()
            await self._chat.show(self.conv)
            self.query_one(Dashboard).conversation_changed("new conversation")

    def on_conversations_screen_renamed(self, message: ConversationsScreen.Renamed) -> None:
        assert self.store is not None
        try:
            self.store.rename(message.conv_id, message.title)
        except StoreError as exc:
            self._store_failed(exc)
            return
        if message.conv_id == self.conv.id:
            self.conv.title = message.title  # the next save keeps it

    async def _open(self, choice: OpenAt | None) -> None:
        assert self.store is not None
        try:
            conv = self.store.load(choice.conv_id) if choice else None
        except StoreError as exc:
            self._store_failed(exc)
            return
        if conv is not None:
            if conv.id != self.conv.id:
                self.query_one(Dashboard).conversation_changed("another conversation")
            self.conv = conv
            await self.query_one(ChatLog).show(conv)
            self.query_one(Composer).measure()
            assert choice is not None
            if choice.message is not None:  # a search's match: focused and scrolled to
                self._chat.reveal(choice.message)

    def action_export(self) -> None:
        if not self.conv.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return
        try:
            path = export_markdown(self.conv, self.export_dir)
        except StoreError as exc:
            self._store_failed(exc, "Export")
            return
        self.notify(f"Exported to {path}", title="Export", timeout=8)

    def _refuse_while_running(self) -> bool:
        if self.running:
            self.notify("Finish or cancel (Esc) the running request first.", severity="warning")
        return self.running

    # -- view --------------------------------------------------------------------------------
    def action_toggle_dashboard(self) -> None:
        self.show_dashboard = not self.show_dashboard
        if not self.narrow:  # a narrow terminal's choice is not the wide layout's
            self._keep(dashboard=self.show_dashboard)

    def action_flags(self) -> None:
        """Show the flags panel and put the focus on its first switch, in one press."""
        self.show_dashboard = True
        self.call_after_refresh(self._to_flags, None, 3, True)

    def _to_flags(self, laid_out: object, tries: int, focus: bool) -> None:
        # a dashboard that was hidden settles in two layouts (its pictures measure their
        # height at the new width): scroll again after each one that changed its height.
        # The focus moves once: a key pressed in between (Escape: back to the input) wins.
        dashboard, panel = self.query_one(Dashboard), self.query_one(FlagsPanel)
        if focus:
            panel.focus_first()
        panel.scroll_visible(top=True, animate=False, immediate=True)
        if tries > 1 and dashboard.virtual_size != laid_out:
            self.call_after_refresh(self._to_flags, dashboard.virtual_size, tries - 1, False)

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    # -- settings ----------------------------------------------------------------------------
    def _new_conversation(self) -> Conversation:
        """A conversation with what new ones take (the settings' system prompt, the sampling
        of the command line or the settings)."""
        return Conversation(system=self.settings.settings.system, sampling=self.settings.sampling)

    def _apply_settings(self) -> None:
        """The kept theme and dashboard; say once why a settings file was not used."""
        settings = self.settings.settings
        self.theme = self.settings.start_theme or self.theme
        # the wide layout's choice (a narrow terminal starts with the strip)
        self.show_dashboard = settings.dashboard and not self.narrow
        self.theme_changed_signal.subscribe(self, lambda theme: self._keep(theme=theme.name))
        if self.config.settings_note:
            self.notify(self.config.settings_note, title="Settings", severity="warning",
                        timeout=20)

    def _keep(self, **changes: object) -> None:
        """Write changed settings; a file that cannot be written is said (kept for this run)."""
        try:
            self.settings.change(**changes)
        except SettingsError as exc:
            self.notify(str(exc), title="Settings", severity="warning", timeout=10)

    def action_chat_settings(self) -> None:
        """The open conversation's system prompt and sampling (F4)."""
        conv = self.conv
        self.push_screen(ChatSettingsScreen(conv.title, conv.system,
                                            conv.sampling or self.settings.sampling,
                                            self.config.options.ctx), self._configure)

    def _configure(self, chosen: ChatSettings | None) -> None:
        """Apply the dialog's choice to the open conversation (and store it with it)."""
        if chosen is None:
            return
        conv = self.conv
        conv.system, conv.sampling = chosen.system, chosen.sampling
        if chosen.make_default:
            self._keep(system=chosen.system, sampling=chosen.sampling)
        if self.store is not None and self._outbox is not None:  # else nothing is saved
            try:
                self.store.configure(conv)
            except StoreError as exc:  # kept in memory: written with the next message
                self.notify(f"{exc}; saved with the next message.", title="Not saved yet",
                            severity="warning", timeout=10)
        self.query_one(Composer).measure()  # the system prompt is part of every prompt
        self.notify("Applies from the next message.", title="System prompt and sampling")

    def action_reset_settings(self) -> None:
        """Every kept setting back to its default, the flags in force included."""
        cfg = self.config
        current = self.flags_in_force()
        defaults = cfg.default_flags or cfg.flags
        if not cfg.connect and current is not None and current[0] != defaults:
            self.request_flags(defaults, current[1])  # first: it keeps what it applies
        self.theme = DEFAULT_THEME
        if not self.narrow:
            self.show_dashboard = True
        try:
            self.settings.reset()
        except SettingsError as exc:
            self.notify(str(exc), title="Settings", severity="warning", timeout=10)
            return
        self.notify("Settings are back to their defaults; new conversations take them.",
                    title="Settings")

    def deliver_screenshot(self, filename: str | None = None, path: str | None = None,
                           time_format: str | None = None) -> str | None:
        """The palette's Screenshot: into Downloads, else the data folder or the working
        directory (`screenshot_dir`); saying so when Downloads was passed over."""
        if path is None:
            folder, why = screenshot_dir()
            path = str(folder)
            if why:
                self.notify(f"{why}: the screenshot goes to {folder}", title="Screenshot")
        return super().deliver_screenshot(filename, path, time_format)

    async def action_quit(self) -> None:
        if self.running:
            await self._keep_partial()
        self.link.cancel()  # a running request rolls back at its next chunk or token
        self.exit()
