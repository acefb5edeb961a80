//! Busy polling after activity (`--busy-poll-us`): a serving core that has just handled an
//! event keeps asking its io driver for completions, without sleeping, for a short window.
//!
//! Why: on virtual machines an idle CPU halts, and waking it again costs a VM exit and entry
//! (tens of microseconds each, more under nested virtualisation), paid twice per proxied
//! request: when the worker's answer arrives and when the client's next request does. The
//! window keeps the core awake across those short gaps; once it passes with nothing to do the
//! core sleeps as before, so an idle gateway spends no CPU. The cost is CPU time in the windows
//! at light load (at most the window once per event); under load there is no idle time to
//! spend.
//!
//! How: one task per core ([`spin`]) goes to the back of the run queue again and again while
//! the window is open. A runnable task makes monoio's loop poll its driver without blocking
//! (io_uring: an enter without waiting, on whose return the completions' task work runs; epoll:
//! a wait with a zero timeout) instead of parking. Two details of monoio 0.2 shape it:
//! - a task that wakes itself is put at the *front* of the queue, so it would run again before
//!   the tasks its own polling made ready; the spinner is therefore woken by a second small
//!   task (a relay), which queues it at the back like any other wake-up;
//! - timers fire only when the loop parks, and a queue that is never empty never parks (while
//!   traffic keeps the window open, request timeouts would stop), so once a millisecond the
//!   spinner waits on a timer that is already due instead: the loop parks with a zero timeout,
//!   fires the due timers, and goes on.
//!
//! Outside the window the task sleeps until [`BusyPoll::touch`] opens the next one.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// One core's busy-poll window.
pub struct BusyPoll {
    /// Length of the window an event opens (zero: never poll without sleeping).
    window: Duration,
    /// The open window's end.
    until: Cell<Option<Instant>>,
    /// The spinning task, while it sleeps between windows.
    sleeper: Cell<Option<Waker>>,
    /// Polls made without sleeping so far (for tests and diagnostics).
    polls: Cell<u64>,
}

impl BusyPoll {
    /// A core's window of `window` after each event (zero disables busy polling).
    pub fn new(window: Duration) -> BusyPoll {
        BusyPoll {
            window,
            until: Cell::new(None),
            sleeper: Cell::new(None),
            polls: Cell::new(0),
        }
    }

    /// Whether busy polling is on at all.
    pub fn enabled(&self) -> bool {
        !self.window.is_zero()
    }

    /// An event happened on this core (a request arrived, went upstream, or was answered):
    /// poll without sleeping until `window` from now.
    pub fn touch(&self) {
        if !self.enabled() {
            return;
        }
        self.until.set(Some(Instant::now() + self.window));
        if let Some(w) = self.sleeper.take() {
            w.wake();
        }
    }

    /// Polls made without sleeping since the core started.
    pub fn polls(&self) -> u64 {
        self.polls.get()
    }

    /// Whether the window is open at `now`.
    fn open_at(&self, now: Instant) -> bool {
        self.until.get().is_some_and(|u| now < u)
    }
}

/// Run the core's busy polling until `stop` says so (checked at least every `check`): poll
/// while the window is open, sleep until the next `touch` otherwise.
pub async fn spin(poll: &BusyPoll, stop: impl Fn() -> bool, check: Duration) {
    if !poll.enabled() {
        return;
    }
    let relay = Rc::new(Relay::default());
    let relay_task = monoio::spawn(RelayLoop(relay.clone()));
    let mut timers_due = Instant::now();
    while !stop() {
        let now = Instant::now();
        if poll.open_at(now) {
            poll.polls.set(poll.polls.get() + 1);
            if now >= timers_due {
                timers_due = now + TIMER_TURN;
                // Due already (the wheel counts whole milliseconds, rounding deadlines up): the
                // loop parks with a zero timeout and fires every due timer.
                let now = monoio::time::Instant::now();
                monoio::time::sleep_until(now.checked_sub(TIMER_TURN).unwrap_or(now)).await;
            } else {
                ToBack {
                    relay: &relay,
                    queued: false,
                }
                .await;
            }
        } else {
            poll.until.set(None);
            // Sleep until touched; wake now and then to see `stop`.
            let _ = monoio::time::timeout(check, Touched(poll)).await;
        }
    }
    relay.done.set(true);
    if let Some(w) = relay.relay.take() {
        w.wake();
    }
    relay_task.await;
}

/// How often a polling core lets the runtime park (with a zero timeout) so its timers fire: the
/// timer wheel's resolution.
const TIMER_TURN: Duration = Duration::from_millis(1);

/// The two wakers of the spinner and its relay task.
#[derive(Default)]
struct Relay {
    /// The spinner, once it has asked to be queued again.
    spinner: Cell<Option<Waker>>,
    /// The relay task, waiting for a spinner to queue.
    relay: Cell<Option<Waker>>,
    /// The spinner has ended: the relay ends too.
    done: Cell<bool>,
}

/// The spinner's step: ask the relay to wake it (so it is queued at the back), ready when it
/// runs again.
struct ToBack<'a> {
    relay: &'a Relay,
    queued: bool,
}

impl Future for ToBack<'_> {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.queued {
            return Poll::Ready(());
        }
        self.queued = true;
        let relay = self.relay;
        relay.spinner.set(Some(cx.waker().clone()));
        match relay.relay.take() {
            Some(r) => r.wake(),
            // The relay has not run yet: queue this task directly (at the front, once).
            None => cx.waker().wake_by_ref(),
        }
        Poll::Pending
    }
}

/// The relay task: whenever woken, wake the spinner if it asked.
struct RelayLoop(Rc<Relay>);

impl Future for RelayLoop {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let relay = &self.0;
        if relay.done.get() {
            return Poll::Ready(());
        }
        if let Some(s) = relay.spinner.take() {
            s.wake();
        }
        relay.relay.set(Some(cx.waker().clone()));
        Poll::Pending
    }
}

/// Ready once a `touch` has opened a window.
struct Touched<'a>(&'a BusyPoll);

impl Future for Touched<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0.until.get().is_some() {
            return Poll::Ready(());
        }
        self.0.sleeper.set(Some(cx.waker().clone()));
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run `f` on a fresh monoio runtime (the driver the test environment picks, timer on) in
    /// its own thread, failing instead of hanging when it takes longer than `limit`.
    fn on_runtime<F, Fut>(limit: Duration, f: F)
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + 'static,
    {
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let mut rt = monoio::RuntimeBuilder::<monoio::FusionDriver>::new()
                .enable_timer()
                .build()
                .expect("runtime");
            rt.block_on(f());
            let _ = done_tx.send(());
        });
        match done_rx.recv_timeout(limit) {
            Ok(()) => t.join().expect("test thread"),
            Err(_) => panic!("the runtime did not finish within {limit:?}"),
        }
    }

    #[test]
    fn a_touch_opens_a_window_that_closes_by_itself() {
        on_runtime(Duration::from_secs(10), || async {
            let poll = Rc::new(BusyPoll::new(Duration::from_millis(5)));
            let stop = Rc::new(Cell::new(false));
            let spinner = {
                let (poll, stop) = (poll.clone(), stop.clone());
                monoio::spawn(
                    async move { spin(&poll, || stop.get(), Duration::from_millis(10)).await },
                )
            };
            monoio::time::sleep(Duration::from_millis(20)).await;
            assert_eq!(poll.polls(), 0, "no event yet: the core must sleep");
            poll.touch();
            monoio::time::sleep(Duration::from_millis(30)).await;
            let after_window = poll.polls();
            assert!(after_window > 0, "a touch must start polling");
            monoio::time::sleep(Duration::from_millis(30)).await;
            assert_eq!(
                poll.polls(),
                after_window,
                "polling went on past the window"
            );
            stop.set(true);
            spinner.await;
        });
    }

    #[test]
    fn a_zero_window_never_polls() {
        on_runtime(Duration::from_secs(10), || async {
            let poll = BusyPoll::new(Duration::ZERO);
            assert!(!poll.enabled());
            poll.touch();
            // Returns at once: nothing to run.
            spin(&poll, || false, Duration::from_millis(10)).await;
            assert_eq!(poll.polls(), 0);
        });
    }

    /// Traffic that keeps renewing the window must not stop the timer wheel (request timeouts
    /// and the client watch are timers), nor wait behind the spinner. A ping-pong over a
    /// socket pair touches on every message, so the window never closes while a 20 ms sleep
    /// must still end on time, and the ping-pong must keep its pace.
    #[test]
    fn timers_fire_while_traffic_keeps_the_window_open() {
        on_runtime(Duration::from_secs(10), || async {
            use monoio::io::{AsyncReadRent, AsyncWriteRentExt};
            let poll = Rc::new(BusyPoll::new(Duration::from_millis(200)));
            let pings = Rc::new(Cell::new(0u64));
            let stop = Rc::new(Cell::new(false));
            let spinner = {
                let (poll, stop) = (poll.clone(), stop.clone());
                monoio::spawn(
                    async move { spin(&poll, || stop.get(), Duration::from_millis(10)).await },
                )
            };
            let listener = monoio::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            let addr = listener.local_addr().expect("addr");
            let mut a = monoio::net::TcpStream::connect(addr)
                .await
                .expect("connect");
            let (mut b, _) = listener.accept().await.expect("accept");
            a.set_nodelay(true).expect("nodelay");
            b.set_nodelay(true).expect("nodelay");
            let pinger = {
                let (poll, stop, pings) = (poll.clone(), stop.clone(), pings.clone());
                monoio::spawn(async move {
                    let mut buf = vec![0u8; 1];
                    while !stop.get() {
                        let (r, _) = a.write_all(vec![1u8]).await;
                        r.expect("write");
                        let (r, back) = a.read(buf).await;
                        buf = back;
                        if r.expect("read") == 0 {
                            break;
                        }
                        poll.touch();
                        pings.set(pings.get() + 1);
                    }
                })
            };
            let ponger = {
                let stop = stop.clone();
                monoio::spawn(async move {
                    let mut buf = vec![0u8; 1];
                    while !stop.get() {
                        let (r, back) = b.read(buf).await;
                        buf = back;
                        if r.expect("read") == 0 {
                            break;
                        }
                        let (r, _) = b.write_all(vec![1u8]).await;
                        r.expect("write");
                    }
                })
            };
            let started = Instant::now();
            monoio::time::sleep(Duration::from_millis(20)).await;
            let took = started.elapsed();
            let polls = poll.polls();
            let pings = pings.get();
            stop.set(true);
            pinger.await;
            ponger.await;
            spinner.await;
            assert!(polls > 0, "the ping-pong must have kept the core polling");
            // The window (200 ms) never closed: the timer fired while the core polled.
            assert!(
                took < Duration::from_millis(150),
                "a 20 ms timer took {took:?}"
            );
            // Without busy polling this ping-pong makes ~1,400 round trips in 20 ms here; a
            // spinner that starves the tasks it wakes (~1 round trip per millisecond) fails.
            assert!(
                pings >= 200,
                "{pings} round trips in {took:?}: the polling starved them"
            );
        });
    }
}
