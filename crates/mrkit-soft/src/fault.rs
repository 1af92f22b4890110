//! A seeded fault injector for links: loss, duplication, reordering, corruption and delay.
//!
//! Sans-IO: [`FaultInjector::push`] takes an outgoing datagram and the current time, and
//! [`FaultInjector::pop`] returns the datagrams due at `now` (in the order the faults produce).
//! The same seed and inputs always give the same outputs, so tests that see a failure can replay
//! it exactly. Configure from code ([`FaultConfig`]) or from `MRKIT_FAULTS`, e.g.
//! `MRKIT_FAULTS="loss=0.1,dup=0.02,reorder=0.05,corrupt=0.01,delay=200us,seed=7"`.
#![forbid(unsafe_code)]

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Fault probabilities (each in 0..=1) and parameters.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct FaultConfig {
    /// Probability a datagram is dropped.
    pub loss: f64,
    /// Probability a datagram is delivered twice.
    pub dup: f64,
    /// Probability a datagram is held back and delivered after the next one.
    pub reorder: f64,
    /// Probability one random bit of a datagram is flipped.
    pub corrupt: f64,
    /// Extra delay applied to every datagram.
    pub delay: Duration,
    /// Random jitter added on top of `delay` (uniform in 0..=jitter).
    pub jitter: Duration,
    /// RNG seed.
    pub seed: u64,
}

impl FaultConfig {
    /// True when no fault is configured.
    pub fn is_clean(&self) -> bool {
        self.loss == 0.0
            && self.dup == 0.0
            && self.reorder == 0.0
            && self.corrupt == 0.0
            && self.delay.is_zero()
            && self.jitter.is_zero()
    }

    /// Parse `key=value` pairs separated by commas: `loss`, `dup`, `reorder`, `corrupt`
    /// (probabilities or percentages like `10%`), `delay`, `jitter` (`200us`, `1ms`, `0.5s`),
    /// `seed`.
    ///
    /// ```
    /// use mrkit_soft::net::fault::FaultConfig;
    /// let c = FaultConfig::parse("loss=10%,reorder=0.05,delay=1ms,seed=3").unwrap();
    /// assert_eq!(c.loss, 0.1);
    /// assert_eq!(c.reorder, 0.05);
    /// assert!(FaultConfig::parse("loss=abc").is_err());
    /// ```
    pub fn parse(s: &str) -> Result<FaultConfig, String> {
        let mut c = FaultConfig::default();
        for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| format!("`{item}`: expected key=value"))?;
            let prob = |v: &str| -> Result<f64, String> {
                let p = match v.strip_suffix('%') {
                    Some(pct) => pct.parse::<f64>().map(|x| x / 100.0),
                    None => v.parse::<f64>(),
                }
                .map_err(|e| format!("`{item}`: {e}"))?;
                if (0.0..=1.0).contains(&p) {
                    Ok(p)
                } else {
                    Err(format!("`{item}`: probability must be within 0..=1"))
                }
            };
            match k.trim() {
                "loss" => c.loss = prob(v)?,
                "dup" | "duplicate" => c.dup = prob(v)?,
                "reorder" => c.reorder = prob(v)?,
                "corrupt" => c.corrupt = prob(v)?,
                "delay" => {
                    c.delay = parse_duration(v).ok_or_else(|| format!("`{item}`: bad duration"))?
                }
                "jitter" => {
                    c.jitter = parse_duration(v).ok_or_else(|| format!("`{item}`: bad duration"))?
                }
                "seed" => c.seed = v.parse().map_err(|e| format!("`{item}`: {e}"))?,
                other => {
                    return Err(format!(
                    "unknown fault `{other}` (loss, dup, reorder, corrupt, delay, jitter, seed)"
                ))
                }
            }
        }
        Ok(c)
    }

    /// Read `MRKIT_FAULTS` (None when unset or empty).
    pub fn from_env() -> Result<Option<FaultConfig>, String> {
        match std::env::var("MRKIT_FAULTS") {
            Ok(s) if !s.trim().is_empty() => FaultConfig::parse(&s)
                .map(Some)
                .map_err(|e| format!("MRKIT_FAULTS: {e}")),
            _ => Ok(None),
        }
    }
}

/// Parse `250us`, `3ms`, `1.5s`, `100ns`.
pub fn parse_duration(s: &str) -> Option<Duration> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (n, unit) = s.split_at(split);
    let n: f64 = n.parse().ok()?;
    let secs = match unit {
        "ns" => n * 1e-9,
        "us" | "µs" => n * 1e-6,
        "ms" => n * 1e-3,
        "s" => n,
        _ => return None,
    };
    (secs >= 0.0).then(|| Duration::from_secs_f64(secs))
}

/// Counters of what the injector did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Datagrams offered.
    pub offered: u64,
    /// Dropped.
    pub dropped: u64,
    /// Duplicated.
    pub duplicated: u64,
    /// Reordered (held back).
    pub reordered: u64,
    /// Corrupted.
    pub corrupted: u64,
}

/// SplitMix64: tiny, fast, good enough for fault decisions, and stable across versions.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn chance(&mut self, p: f64) -> bool {
        let x = (self.next() >> 11) as f64 / (1u64 << 53) as f64;
        p > 0.0 && x < p
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// The injector: a queue of datagrams with their release times.
#[derive(Debug)]
pub struct FaultInjector<T> {
    cfg: FaultConfig,
    rng: Rng,
    /// Due datagrams, ordered by release time (ties keep insertion order).
    queue: VecDeque<(Instant, T)>,
    /// A datagram held back for reordering: released right after the next one.
    held: Option<T>,
    stats: FaultStats,
}

/// What a datagram must offer to be corrupted.
pub trait Corruptible {
    /// Flip bit `bit` (modulo the length in bits); no-op on empty data.
    fn flip_bit(&mut self, bit: u64);
}

impl Corruptible for Vec<u8> {
    fn flip_bit(&mut self, bit: u64) {
        if !self.is_empty() {
            let b = (bit % (self.len() as u64 * 8)) as usize;
            self[b / 8] ^= 1 << (b % 8);
        }
    }
}

impl<T: Clone + Corruptible> FaultInjector<T> {
    /// A new injector.
    pub fn new(cfg: FaultConfig) -> FaultInjector<T> {
        FaultInjector {
            rng: Rng(cfg.seed ^ 0x6d72_6b69_7466_6c74),
            cfg,
            queue: VecDeque::new(),
            held: None,
            stats: FaultStats::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &FaultConfig {
        &self.cfg
    }

    /// What happened so far.
    pub fn stats(&self) -> FaultStats {
        self.stats
    }

    fn enqueue(&mut self, at: Instant, d: T) {
        let pos = self
            .queue
            .iter()
            .rposition(|(t, _)| *t <= at)
            .map_or(0, |p| p + 1);
        self.queue.insert(pos, (at, d));
    }

    fn release_time(&mut self, now: Instant) -> Instant {
        let j = self.cfg.jitter.as_nanos() as u64;
        now + self.cfg.delay + Duration::from_nanos(self.rng.below(j + 1))
    }

    /// Offer an outgoing datagram at `now`.
    pub fn push(&mut self, now: Instant, mut d: T) {
        self.stats.offered += 1;
        if self.rng.chance(self.cfg.loss) {
            self.stats.dropped += 1;
            return;
        }
        if self.rng.chance(self.cfg.corrupt) {
            self.stats.corrupted += 1;
            let bit = self.rng.next();
            d.flip_bit(bit);
        }
        let dup = self.rng.chance(self.cfg.dup);
        if self.held.is_none() && self.rng.chance(self.cfg.reorder) {
            self.stats.reordered += 1;
            self.held = Some(d);
            return;
        }
        let at = self.release_time(now);
        if dup {
            self.stats.duplicated += 1;
            self.enqueue(at, d.clone());
        }
        self.enqueue(at, d);
        if let Some(h) = self.held.take() {
            self.enqueue(at, h);
        }
    }

    /// Next datagram due at `now`, if any.
    pub fn pop(&mut self, now: Instant) -> Option<T> {
        match self.queue.front() {
            Some((t, _)) if *t <= now => self.queue.pop_front().map(|(_, d)| d),
            _ => None,
        }
    }

    /// When the next queued datagram is due (for the driver's timer).
    pub fn next_due(&self) -> Option<Instant> {
        self.queue.front().map(|(t, _)| *t)
    }

    /// Release a held-back datagram (e.g. when the link goes idle, so reordering never turns
    /// into loss of the last packet).
    pub fn flush_held(&mut self, now: Instant) {
        if let Some(h) = self.held.take() {
            let at = self.release_time(now);
            self.enqueue(at, h);
        }
    }

    /// Datagrams waiting (queued or held).
    pub fn pending(&self) -> usize {
        self.queue.len() + usize::from(self.held.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(f: &mut FaultInjector<Vec<u8>>, now: Instant) -> Vec<Vec<u8>> {
        f.flush_held(now);
        let mut out = Vec::new();
        while let Some(d) = f.pop(now + Duration::from_secs(3600)) {
            out.push(d);
        }
        out
    }

    #[test]
    fn clean_link_is_transparent() {
        let mut f = FaultInjector::new(FaultConfig::default());
        let now = Instant::now();
        for i in 0..100u8 {
            f.push(now, vec![i]);
        }
        let out = drain(&mut f, now);
        assert_eq!(out, (0..100u8).map(|i| vec![i]).collect::<Vec<_>>());
    }

    #[test]
    fn same_seed_same_faults() {
        let cfg = FaultConfig::parse("loss=10%,dup=0.05,reorder=0.1,corrupt=0.02,seed=9").unwrap();
        let run = || {
            let mut f = FaultInjector::new(cfg);
            let now = Instant::now();
            for i in 0..1000u32 {
                f.push(now, i.to_le_bytes().to_vec());
            }
            (drain(&mut f, now), f.stats())
        };
        assert_eq!(run(), run());
        let (_, st) = run();
        assert!((60..=140).contains(&st.dropped), "{st:?}");
        assert!(
            st.duplicated > 20 && st.reordered > 50 && st.corrupted > 5,
            "{st:?}"
        );
    }

    #[test]
    fn reorder_swaps_neighbours() {
        let cfg = FaultConfig {
            reorder: 1.0,
            ..Default::default()
        };
        let mut f = FaultInjector::new(cfg);
        let now = Instant::now();
        f.push(now, vec![1]);
        f.push(now, vec![2]);
        assert_eq!(drain(&mut f, now), vec![vec![2], vec![1]]);
    }

    #[test]
    fn delay_holds_until_due() {
        let cfg = FaultConfig::parse("delay=1ms").unwrap();
        let mut f = FaultInjector::new(cfg);
        let now = Instant::now();
        f.push(now, vec![1]);
        assert!(f.pop(now).is_none());
        assert_eq!(f.next_due(), Some(now + Duration::from_millis(1)));
        assert_eq!(f.pop(now + Duration::from_millis(1)), Some(vec![1]));
    }

    #[test]
    fn parse_errors() {
        assert!(FaultConfig::parse("loss=2").is_err());
        assert!(FaultConfig::parse("bogus=1").is_err());
        assert!(FaultConfig::parse("delay=fast").is_err());
        assert_eq!(parse_duration("250us"), Some(Duration::from_micros(250)));
    }
}
