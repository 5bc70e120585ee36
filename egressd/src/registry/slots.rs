//! Connection slots, per lease and per gateway (issue #14, hole 7): pure arithmetic,
//! table-tested; [`super`] holds the counts and calls [`admit`] under one lock.
//!
//! A lease is one sandbox (it has its own socket, so every connection on it is that
//! sandbox's, whatever process inside opened it). Each lease
//! * may hold at most `per_lease` connections at once (429 beyond), and
//! * is *guaranteed* its first `reserved` connections, which never come out of the gateway's
//!   pool, so sandboxes of the same policy can fill the pool and another still gets out;
//! * beyond those it draws from the gateway's shared `pool` (429 when that is empty).
//!
//! So one lease never holds all of a gateway's slots (`per_lease` ≤ `pool` / 2), and a
//! gateway holds at most `pool + reserved × leases` connections.

/// The caps, derived from `--max-tunnels` (the pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    /// A gateway's shared slots.
    pub pool: usize,
    /// The most connections one lease holds at once, reserved ones included.
    pub per_lease: usize,
    /// Slots every lease has outside the pool.
    pub reserved: usize,
}

/// A lease's guaranteed slots are at most this many.
pub const MAX_RESERVED: usize = 8;

impl Caps {
    /// Half the pool per lease, and up to [`MAX_RESERVED`] (at most half of that) reserved.
    pub fn from_max_tunnels(max_tunnels: usize) -> Caps {
        let pool = max_tunnels.max(1);
        let per_lease = (pool / 2).max(1);
        let reserved = (per_lease / 2).clamp(1, MAX_RESERVED);
        Caps { pool, per_lease, reserved }
    }
}

/// Where an admitted connection's slot comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    Reserved,
    Pool,
}

/// Why a connection is refused (429).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The lease holds `per_lease` connections.
    LeaseFull,
    /// The lease's reserved slots are taken and the gateway's pool is empty.
    PoolFull,
}

/// What one lease holds now.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Held {
    /// Open connections (reserved + pool).
    pub open: usize,
    /// Of which in reserved slots.
    pub reserved: usize,
}

/// The verdict on one more connection of a lease holding `held`, with `pool_in_use` of the
/// gateway's pool taken.
pub fn admit(caps: &Caps, held: Held, pool_in_use: usize) -> Result<Slot, Refusal> {
    if held.open >= caps.per_lease {
        return Err(Refusal::LeaseFull);
    }
    if held.reserved < caps.reserved {
        return Ok(Slot::Reserved);
    }
    if pool_in_use < caps.pool {
        return Ok(Slot::Pool);
    }
    Err(Refusal::PoolFull)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_from_max_tunnels() {
        let caps = |m| {
            let c = Caps::from_max_tunnels(m);
            (c.pool, c.per_lease, c.reserved)
        };
        assert_eq!(caps(256), (256, 128, MAX_RESERVED));
        assert_eq!(caps(8), (8, 4, 2));
        assert_eq!(caps(3), (3, 1, 1));
        assert_eq!(caps(2), (2, 1, 1));
        assert_eq!(caps(1), (1, 1, 1));
        assert_eq!(caps(0), (1, 1, 1), "never a cap of zero");
        for m in 1..600 {
            let c = Caps::from_max_tunnels(m);
            assert!(c.reserved >= 1 && c.reserved <= c.per_lease, "{c:?}");
            assert!(m < 2 || c.per_lease <= c.pool / 2, "one lease never takes the whole pool: {c:?}");
        }
    }

    #[test]
    fn admission_table() {
        let caps = Caps { pool: 8, per_lease: 4, reserved: 2 };
        let held = |open, reserved| Held { open, reserved };
        for (h, pool_in_use, verdict) in [
            (held(0, 0), 0, Ok(Slot::Reserved)),
            (held(1, 1), 0, Ok(Slot::Reserved)),
            // The reserved slots come first and hold even when the pool is empty.
            (held(0, 0), 8, Ok(Slot::Reserved)),
            (held(1, 1), 8, Ok(Slot::Reserved)),
            (held(2, 2), 0, Ok(Slot::Pool)),
            (held(3, 2), 7, Ok(Slot::Pool)),
            (held(2, 2), 8, Err(Refusal::PoolFull)),
            // A reserved slot freed while pool slots are held is taken again first.
            (held(3, 1), 8, Ok(Slot::Reserved)),
            (held(4, 2), 0, Err(Refusal::LeaseFull)),
            (held(4, 1), 0, Err(Refusal::LeaseFull)),
        ] {
            assert_eq!(admit(&caps, h, pool_in_use), verdict, "{h:?} pool {pool_in_use}");
        }
    }

    #[test]
    fn leases_filling_the_pool_leave_every_other_lease_its_reserve() {
        // Four greedy leases take all they can (2 reserved + 2 pooled each), then a fifth asks.
        let caps = Caps::from_max_tunnels(8);
        let mut pool = 0;
        let mut greedy = [Held::default(); 4];
        for lease in &mut greedy {
            while let Ok(slot) = admit(&caps, *lease, pool) {
                lease.open += 1;
                match slot {
                    Slot::Reserved => lease.reserved += 1,
                    Slot::Pool => pool += 1,
                }
            }
        }
        assert_eq!(pool, caps.pool, "the greedy leases emptied the pool");
        assert!(greedy.iter().all(|l| l.open <= caps.per_lease), "{greedy:?}");
        let mut late = Held::default();
        for _ in 0..caps.reserved {
            assert_eq!(admit(&caps, late, pool), Ok(Slot::Reserved));
            late.open += 1;
            late.reserved += 1;
        }
        assert_eq!(admit(&caps, late, pool), Err(Refusal::PoolFull));
    }
}
