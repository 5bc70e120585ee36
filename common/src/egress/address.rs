//! Classification of resolved addresses: which ones a sandbox may dial.
//!
//! An explicit table rather than std's `is_*` helpers: `Ipv6Addr::is_loopback` is false for
//! `::ffff:127.0.0.1`, `to_ipv4` maps `::1` to `0.0.0.1`, and `is_global` is unstable.
//! IPv6 is allowed only inside 2000::/3, minus the rows below.
//!
//! Stricter than the original on purpose: the cloud instance metadata addresses are
//! [`Class::Never`], so even `allowPrivateNetwork` does not open them (they hand out the
//! host's credentials). So are the IPv6 forms that embed an IPv4 address we cannot vet:
//! NAT64 (64:ff9b::/96, 64:ff9b:1::/48), 6to4 (2002::/16) and Teredo (2001::/32) reach
//! whatever IPv4 host the translator or relay picks, loopback and metadata included. On a
//! DNS64 network this refuses v4-only names; supporting that would mean classifying the
//! embedded address, and is left for when a deployment needs it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// How a resolved address may be used. The labels are short range names for audit logs and
/// the 403 reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    Public,
    /// Refused unless `allowPrivateNetwork`.
    Private(&'static str),
    /// Refused always, even with `allowPrivateNetwork`.
    Never(&'static str),
}

/// The label of a match against [`classify`]'s `own` list.
pub const OWN_ADDRESS: &str = "this host's own address";

const METADATA: &str = "cloud metadata address";

/// IPv4 rows, most specific first: the first match wins.
const V4: &[(Ipv4Addr, u8, Class)] = &[
    (Ipv4Addr::new(169, 254, 169, 254), 32, Class::Never(METADATA)),
    (Ipv4Addr::new(169, 254, 170, 2), 32, Class::Never(METADATA)),
    (Ipv4Addr::new(100, 100, 100, 200), 32, Class::Never(METADATA)),
    (Ipv4Addr::new(192, 0, 0, 192), 32, Class::Never(METADATA)),
    (Ipv4Addr::new(0, 0, 0, 0), 8, Class::Never("this network (0.0.0.0/8)")),
    (Ipv4Addr::new(224, 0, 0, 0), 4, Class::Never("multicast")),
    (Ipv4Addr::new(255, 255, 255, 255), 32, Class::Never("broadcast")),
    (Ipv4Addr::new(240, 0, 0, 0), 4, Class::Never("reserved (240.0.0.0/4)")),
    (Ipv4Addr::new(10, 0, 0, 0), 8, Class::Private("private (10.0.0.0/8)")),
    (Ipv4Addr::new(172, 16, 0, 0), 12, Class::Private("private (172.16.0.0/12)")),
    (Ipv4Addr::new(192, 168, 0, 0), 16, Class::Private("private (192.168.0.0/16)")),
    (Ipv4Addr::new(100, 64, 0, 0), 10, Class::Private("shared address space (100.64.0.0/10)")),
    (Ipv4Addr::new(127, 0, 0, 0), 8, Class::Private("loopback")),
    (Ipv4Addr::new(169, 254, 0, 0), 16, Class::Private("link-local")),
    (Ipv4Addr::new(192, 0, 0, 0), 24, Class::Private("IETF protocol assignments (192.0.0.0/24)")),
    (Ipv4Addr::new(192, 0, 2, 0), 24, Class::Private("documentation")),
    (Ipv4Addr::new(198, 51, 100, 0), 24, Class::Private("documentation")),
    (Ipv4Addr::new(203, 0, 113, 0), 24, Class::Private("documentation")),
    (Ipv4Addr::new(198, 18, 0, 0), 15, Class::Private("benchmarking")),
];

/// IPv6 rows after canonicalisation (IPv4-mapped addresses have become IPv4), most specific
/// first. Anything else outside 2000::/3 is [`Class::Never`] "not global unicast".
const V6: &[(Ipv6Addr, u8, Class)] = &[
    (Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x0254), 128, Class::Never(METADATA)),
    (Ipv6Addr::UNSPECIFIED, 128, Class::Never("unspecified")),
    (Ipv6Addr::LOCALHOST, 128, Class::Private("loopback")),
    (Ipv6Addr::UNSPECIFIED, 96, Class::Never("IPv4-compatible (::/96)")),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8, Class::Never("multicast")),
    (Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, 0, 0), 96, Class::Never("NAT64 (embeds an IPv4 address)")),
    (Ipv6Addr::new(0x64, 0xff9b, 1, 0, 0, 0, 0, 0), 48, Class::Never("NAT64 (embeds an IPv4 address)")),
    (Ipv6Addr::new(0x2002, 0, 0, 0, 0, 0, 0, 0), 16, Class::Never("6to4 (embeds an IPv4 address)")),
    (Ipv6Addr::new(0x2001, 0, 0, 0, 0, 0, 0, 0), 32, Class::Never("Teredo (embeds an IPv4 address)")),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10, Class::Private("link-local")),
    (Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0), 7, Class::Private("unique local")),
    (Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10, Class::Private("site-local (deprecated)")),
    // Inside 2000::/3 but not routed: treated like their IPv4 counterparts.
    (Ipv6Addr::new(0x2001, 0x0db8, 0, 0, 0, 0, 0, 0), 32, Class::Private("documentation")),
    (Ipv6Addr::new(0x3fff, 0, 0, 0, 0, 0, 0, 0), 20, Class::Private("documentation")),
    (Ipv6Addr::new(0x2001, 0x0002, 0, 0, 0, 0, 0, 0), 48, Class::Private("benchmarking")),
];

/// Classifies one resolved address. Canonicalises (`IpAddr::to_canonical`) first, so
/// `::ffff:a.b.c.d` follows the IPv4 rows; `own` = this host's interface addresses (also
/// canonicalised), classified `Private("this host's own address")`.
///
/// Order: the [`Class::Never`] rows, then `own`, then the [`Class::Private`] rows, so a
/// metadata address stays `Never` even when it is also an own address.
pub fn classify(ip: IpAddr, own: &[IpAddr]) -> Class {
    let ip = ip.to_canonical();
    let row = match ip {
        IpAddr::V4(v4) => lookup(V4, u32::from(v4).into(), 32, |a| u32::from(a).into()),
        IpAddr::V6(v6) => lookup(V6, u128::from(v6), 128, u128::from),
    };
    if let Some(never @ Class::Never(_)) = row {
        return never;
    }
    if own.iter().any(|o| o.to_canonical() == ip) {
        return Class::Private(OWN_ADDRESS);
    }
    if let Some(class) = row {
        return class;
    }
    match ip {
        IpAddr::V6(v6) if v6.segments()[0] & 0xe000 != 0x2000 => Class::Never("not global unicast"),
        _ => Class::Public,
    }
}

/// Whether dialling `ip` is permitted under this policy.
///
/// The error is the range label, for the audit log and the 403 reason.
pub fn permitted(ip: IpAddr, own: &[IpAddr], allow_private_network: bool) -> Result<(), &'static str> {
    match classify(ip, own) {
        Class::Public => Ok(()),
        Class::Private(_) if allow_private_network => Ok(()),
        Class::Private(label) | Class::Never(label) => Err(label),
    }
}

/// The first row whose prefix contains `value` (`bits` wide).
fn lookup<A: Copy>(table: &[(A, u8, Class)], value: u128, bits: u32, to_int: fn(A) -> u128) -> Option<Class> {
    table.iter().find(|(net, len, _)| in_prefix(value, to_int(*net), u32::from(*len), bits)).map(|row| row.2)
}

/// Whether the top `len` of `bits` bits of `value` equal those of `net`.
fn in_prefix(value: u128, net: u128, len: u32, bits: u32) -> bool {
    if len == 0 {
        return true;
    }
    let shift = bits - len;
    (value >> shift) == (net >> shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// egressd's unit asks the kernel to refuse exactly the addresses the policy classes as
    /// cloud metadata: a second wall that must not fall behind the first.
    #[test]
    fn the_units_address_deny_list_is_the_metadata_rows() {
        let unit = include_str!("../../../systemd/egressd.service");
        let line = unit.lines().find_map(|l| l.strip_prefix("IPAddressDeny=")).expect("IPAddressDeny= line");
        let mut denied: Vec<IpAddr> = line.split_whitespace().map(|a| a.parse().unwrap()).collect();
        let mut metadata: Vec<IpAddr> = V4
            .iter()
            .filter(|(_, _, c)| *c == Class::Never(METADATA))
            .map(|(a, _, _)| IpAddr::V4(*a))
            .chain(V6.iter().filter(|(_, _, c)| *c == Class::Never(METADATA)).map(|(a, _, _)| IpAddr::V6(*a)))
            .collect();
        denied.sort();
        metadata.sort();
        assert_eq!(denied, metadata);
    }

    const PUBLIC: Class = Class::Public;

    fn private(label: &'static str) -> Class {
        Class::Private(label)
    }
    fn never(label: &'static str) -> Class {
        Class::Never(label)
    }

    fn check(cases: &[(&str, Class)], own: &[IpAddr]) {
        for (text, expected) in cases {
            let ip: IpAddr = text.parse().unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(classify(ip, own), *expected, "{text}");
        }
    }

    #[test]
    fn ipv4_rows_with_boundaries() {
        let p10 = private("private (10.0.0.0/8)");
        let p172 = private("private (172.16.0.0/12)");
        let p192 = private("private (192.168.0.0/16)");
        let cgnat = private("shared address space (100.64.0.0/10)");
        let lo = private("loopback");
        let ll = private("link-local");
        let ietf = private("IETF protocol assignments (192.0.0.0/24)");
        let doc = private("documentation");
        let bench = private("benchmarking");
        let meta = never(METADATA);
        check(
            &[
                ("0.0.0.0", never("this network (0.0.0.0/8)")),
                ("0.255.255.255", never("this network (0.0.0.0/8)")),
                ("1.0.0.0", PUBLIC),
                ("9.255.255.255", PUBLIC),
                ("10.0.0.0", p10),
                ("10.1.2.3", p10),
                ("10.255.255.255", p10),
                ("11.0.0.0", PUBLIC),
                ("172.15.255.255", PUBLIC),
                ("172.16.0.0", p172),
                ("172.16.0.1", p172),
                ("172.31.255.255", p172),
                ("172.32.0.0", PUBLIC),
                ("192.167.255.255", PUBLIC),
                ("192.168.0.0", p192),
                ("192.168.1.1", p192),
                ("192.168.255.255", p192),
                ("192.169.0.0", PUBLIC),
                ("100.63.255.255", PUBLIC),
                ("100.64.0.0", cgnat),
                ("100.64.0.1", cgnat),
                ("100.100.100.199", cgnat),
                ("100.100.100.200", meta),
                ("100.100.100.201", cgnat),
                ("100.127.255.255", cgnat),
                ("100.128.0.0", PUBLIC),
                ("126.255.255.255", PUBLIC),
                ("127.0.0.0", lo),
                ("127.0.0.1", lo),
                ("127.255.255.255", lo),
                ("128.0.0.0", PUBLIC),
                ("169.253.255.255", PUBLIC),
                ("169.254.0.0", ll),
                ("169.254.1.1", ll),
                ("169.254.169.253", ll),
                ("169.254.169.254", meta),
                ("169.254.169.255", ll),
                ("169.254.170.1", ll),
                ("169.254.170.2", meta),
                ("169.254.170.3", ll),
                ("169.254.255.255", ll),
                ("169.255.0.0", PUBLIC),
                ("191.255.255.255", PUBLIC),
                ("192.0.0.0", ietf),
                ("192.0.0.191", ietf),
                ("192.0.0.192", meta),
                ("192.0.0.193", ietf),
                ("192.0.0.255", ietf),
                ("192.0.1.0", PUBLIC),
                ("192.0.1.255", PUBLIC),
                ("192.0.2.0", doc),
                ("192.0.2.255", doc),
                ("192.0.3.0", PUBLIC),
                ("198.50.255.255", PUBLIC),
                ("198.51.100.0", doc),
                ("198.51.100.255", doc),
                ("198.51.101.0", PUBLIC),
                ("203.0.112.255", PUBLIC),
                ("203.0.113.0", doc),
                ("203.0.113.255", doc),
                ("203.0.114.0", PUBLIC),
                ("198.17.255.255", PUBLIC),
                ("198.18.0.0", bench),
                ("198.19.255.255", bench),
                ("198.20.0.0", PUBLIC),
                ("223.255.255.255", PUBLIC),
                ("224.0.0.0", never("multicast")),
                ("239.255.255.255", never("multicast")),
                ("240.0.0.0", never("reserved (240.0.0.0/4)")),
                ("255.255.255.254", never("reserved (240.0.0.0/4)")),
                ("255.255.255.255", never("broadcast")),
                ("93.184.216.34", PUBLIC),
                ("1.1.1.1", PUBLIC),
                ("8.8.8.8", PUBLIC),
            ],
            &[],
        );
    }

    #[test]
    fn ipv6_rows_with_boundaries() {
        let embeds = |what| never(what);
        let not_global = never("not global unicast");
        check(
            &[
                ("::", never("unspecified")),
                ("::1", private("loopback")),
                ("::2", never("IPv4-compatible (::/96)")),
                ("::127.0.0.1", never("IPv4-compatible (::/96)")),
                ("::169.254.169.254", never("IPv4-compatible (::/96)")),
                ("::255.255.255.255", never("IPv4-compatible (::/96)")),
                ("::1:0:0", not_global),
                ("::fffe:ffff:ffff", not_global),
                ("::ffff:0:0:0", not_global),
                ("100::", not_global),
                ("1fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", not_global),
                ("2000::", PUBLIC),
                ("3fff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", PUBLIC),
                ("4000::", not_global),
                ("2606:2800:220:1:248:1893:25c8:1946", PUBLIC),
                ("2001:4860:4860::8888", PUBLIC),
                ("64:ff9a:ffff:ffff:ffff:ffff:ffff:ffff", not_global),
                ("64:ff9b::", embeds("NAT64 (embeds an IPv4 address)")),
                ("64:ff9b::a9fe:a9fe", embeds("NAT64 (embeds an IPv4 address)")),
                ("64:ff9b::5db8:d822", embeds("NAT64 (embeds an IPv4 address)")),
                ("64:ff9b::ffff:ffff", embeds("NAT64 (embeds an IPv4 address)")),
                ("64:ff9b::1:0:0", not_global),
                ("64:ff9b:1::", embeds("NAT64 (embeds an IPv4 address)")),
                ("64:ff9b:1:ffff:ffff:ffff:ffff:ffff", embeds("NAT64 (embeds an IPv4 address)")),
                ("64:ff9b:2::", not_global),
                ("2001:ffff:ffff:ffff:ffff:ffff:ffff:ffff", PUBLIC),
                ("2002::", embeds("6to4 (embeds an IPv4 address)")),
                ("2002:a9fe:a9fe::", embeds("6to4 (embeds an IPv4 address)")),
                ("2002:ffff:ffff:ffff:ffff:ffff:ffff:ffff", embeds("6to4 (embeds an IPv4 address)")),
                ("2003::", PUBLIC),
                ("2000:ffff:ffff:ffff:ffff:ffff:ffff:ffff", PUBLIC),
                ("2001::", embeds("Teredo (embeds an IPv4 address)")),
                ("2001:0:ffff:ffff:ffff:ffff:ffff:ffff", embeds("Teredo (embeds an IPv4 address)")),
                ("2001:1::", PUBLIC),
                ("2001:1:ffff:ffff:ffff:ffff:ffff:ffff", PUBLIC),
                ("2001:2::", private("benchmarking")),
                ("2001:2:0:ffff:ffff:ffff:ffff:ffff", private("benchmarking")),
                ("2001:2:1::", PUBLIC),
                ("2001:db7:ffff:ffff:ffff:ffff:ffff:ffff", PUBLIC),
                ("2001:db8::", private("documentation")),
                ("2001:db8:ffff:ffff:ffff:ffff:ffff:ffff", private("documentation")),
                ("2001:db9::", PUBLIC),
                ("3ffe:ffff:ffff:ffff:ffff:ffff:ffff:ffff", PUBLIC),
                ("3fff::", private("documentation")),
                ("3fff:fff:ffff:ffff:ffff:ffff:ffff:ffff", private("documentation")),
                ("3fff:1000::", PUBLIC),
                ("fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", not_global),
                ("fc00::", private("unique local")),
                ("fd00::1", private("unique local")),
                ("fd00:ec2::253", private("unique local")),
                ("fd00:ec2::254", never(METADATA)),
                ("fd00:ec2::255", private("unique local")),
                ("fdff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", private("unique local")),
                ("fe00::", not_global),
                ("fe7f:ffff:ffff:ffff:ffff:ffff:ffff:ffff", not_global),
                ("fe80::", private("link-local")),
                ("fe80::1", private("link-local")),
                ("febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", private("link-local")),
                ("fec0::", private("site-local (deprecated)")),
                ("feff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", private("site-local (deprecated)")),
                ("ff00::", never("multicast")),
                ("ff02::1", never("multicast")),
                ("ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", never("multicast")),
            ],
            &[],
        );
    }

    #[test]
    fn ipv4_mapped_follows_ipv4_rules() {
        check(
            &[
                ("::ffff:127.0.0.1", private("loopback")),
                ("::ffff:10.0.0.1", private("private (10.0.0.0/8)")),
                ("::ffff:169.254.169.254", never(METADATA)),
                ("::ffff:0.0.0.0", never("this network (0.0.0.0/8)")),
                ("::ffff:255.255.255.255", never("broadcast")),
                ("::ffff:93.184.216.34", PUBLIC),
                ("::ffff:0:0", never("this network (0.0.0.0/8)")),
            ],
            &[],
        );
    }

    #[test]
    fn own_addresses() {
        let own: Vec<IpAddr> =
            ["203.0.113.7", "198.51.100.9", "2606:4700::6810:84e5", "::ffff:8.8.4.4", "169.254.169.254"]
                .iter()
                .map(|s| s.parse().unwrap())
                .collect();
        check(
            &[
                ("203.0.113.7", private(OWN_ADDRESS)),
                ("::ffff:203.0.113.7", private(OWN_ADDRESS)),
                ("2606:4700::6810:84e5", private(OWN_ADDRESS)),
                ("2606:4700::6810:84e6", PUBLIC),
                ("8.8.4.4", private(OWN_ADDRESS)),
                ("8.8.8.8", PUBLIC),
                ("169.254.169.254", never(METADATA)),
                ("203.0.113.8", private("documentation")),
            ],
            &own,
        );
    }

    /// The original's `isPrivateAddress` vectors (internals §3.5).
    #[test]
    fn original_vectors() {
        for text in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.1.1",
            "100.64.0.1",
            "::1",
            "fe80::1",
            "fd00::1",
            "::ffff:127.0.0.1",
        ] {
            let ip: IpAddr = text.parse().unwrap();
            assert!(matches!(classify(ip, &[]), Class::Private(_)), "{text}");
            assert_eq!(permitted(ip, &[], true), Ok(()), "{text} with allowPrivateNetwork");
            assert!(permitted(ip, &[], false).is_err(), "{text}");
        }
        for text in ["93.184.216.34", "2606:2800:220:1:248:1893:25c8:1946"] {
            let ip: IpAddr = text.parse().unwrap();
            assert_eq!(classify(ip, &[]), Class::Public, "{text}");
            assert_eq!(permitted(ip, &[], false), Ok(()), "{text}");
        }
    }

    #[test]
    fn permitted_table() {
        let own: [IpAddr; 1] = ["192.0.2.1".parse().unwrap()];
        let cases: &[(&str, bool, Result<(), &str>)] = &[
            ("93.184.216.34", false, Ok(())),
            ("127.0.0.1", false, Err("loopback")),
            ("127.0.0.1", true, Ok(())),
            ("192.0.2.1", false, Err(OWN_ADDRESS)),
            ("192.0.2.1", true, Ok(())),
            ("169.254.169.254", true, Err(METADATA)),
            ("100.100.100.200", true, Err(METADATA)),
            ("fd00:ec2::254", true, Err(METADATA)),
            ("::ffff:169.254.169.254", true, Err(METADATA)),
            ("0.0.0.0", true, Err("this network (0.0.0.0/8)")),
            ("::", true, Err("unspecified")),
            ("::127.0.0.1", true, Err("IPv4-compatible (::/96)")),
            ("64:ff9b::7f00:1", true, Err("NAT64 (embeds an IPv4 address)")),
            ("ff02::1", true, Err("multicast")),
            ("fe80::1", true, Ok(())),
        ];
        for (text, allow, expected) in cases {
            assert_eq!(permitted(text.parse().unwrap(), &own, *allow), *expected, "{text} allow={allow}");
        }
    }

    /// Every row: its first and last address fall in the row or in a narrower row inside it,
    /// which catches a mistyped network or prefix length.
    #[test]
    fn every_row_covers_its_own_range() {
        for (net, len, class) in V4 {
            let host = u32::MAX.checked_shr(u32::from(*len)).unwrap_or(0);
            let first = u32::from(*net);
            assert_eq!(first & host, 0, "{net}/{len} has host bits");
            for addr in [first, first | host] {
                let got = classify(IpAddr::V4(Ipv4Addr::from(addr)), &[]);
                assert!(got == *class || narrower_row(V4, *len, got), "{net}/{len}: {got:?}");
            }
        }
        for (net, len, class) in V6 {
            let host = u128::MAX.checked_shr(u32::from(*len)).unwrap_or(0);
            let first = u128::from(*net);
            assert_eq!(first & host, 0, "{net}/{len} has host bits");
            for addr in [first, first | host] {
                let got = classify(IpAddr::V6(Ipv6Addr::from(addr)), &[]);
                assert!(got == *class || narrower_row(V6, *len, got), "{net}/{len}: {got:?}");
            }
        }
    }

    fn narrower_row<A>(table: &[(A, u8, Class)], len: u8, got: Class) -> bool {
        table.iter().any(|row| row.1 > len && row.2 == got)
    }
}
