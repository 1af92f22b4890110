//! The kernel's RDMA netlink resource dump (what `rdma resource show mr` reads): every MR of
//! every process on the kernel's RDMA devices, with pid, length and keys (the keys only for a
//! caller with CAP_NET_ADMIN, as the kernel decides).
//!
//! Protocol: `NETLINK_RDMA`, client `RDMA_NL_NLDEV` (5); first `RDMA_NLDEV_CMD_GET` (1) as a
//! dump lists the devices (index, name), then `RDMA_NLDEV_CMD_RES_MR_GET` (13) as a dump with
//! the device index lists that device's MRs, each a nested `RES_MR_ENTRY` inside `RES_MR`.

use std::time::Duration;

/// `RDMA_NL_NLDEV`.
const NLDEV: u16 = 5;
/// `RDMA_NLDEV_CMD_GET`.
pub const CMD_GET: u16 = 1;
/// `RDMA_NLDEV_CMD_RES_MR_GET`.
pub const CMD_RES_MR_GET: u16 = 13;
/// `RDMA_NL_GET_TYPE(client, op)`.
pub const fn msg_type(op: u16) -> u16 {
    (NLDEV << 10) + op
}

/// `enum rdma_nldev_attr` values used here.
pub mod attr {
    /// u32.
    pub const DEV_INDEX: u16 = 1;
    /// string.
    pub const DEV_NAME: u16 = 2;
    /// u32.
    pub const RES_PID: u16 = 28;
    /// string (kernel objects only).
    pub const RES_KERN_NAME: u16 = 29;
    /// nested.
    pub const RES_MR: u16 = 40;
    /// nested.
    pub const RES_MR_ENTRY: u16 = 41;
    /// u32.
    pub const RES_RKEY: u16 = 42;
    /// u32.
    pub const RES_LKEY: u16 = 43;
    /// u64.
    pub const RES_IOVA: u16 = 44;
    /// u64.
    pub const RES_MRLEN: u16 = 45;
    /// u32.
    pub const RES_PDN: u16 = 60;
    /// u32.
    pub const RES_MRN: u16 = 62;
}

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_DUMP: u16 = 0x300;
const NLA_TYPE_MASK: u16 = 0x3fff;

/// One MR of the dump.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelMr {
    /// Device name.
    pub dev: String,
    /// Owner pid (None: a kernel MR).
    pub pid: Option<u32>,
    /// Kernel owner's name, for kernel MRs.
    pub kern_name: Option<String>,
    /// MR length.
    pub length: Option<u64>,
    /// lkey (CAP_NET_ADMIN only).
    pub lkey: Option<u32>,
    /// rkey (CAP_NET_ADMIN only).
    pub rkey: Option<u32>,
    /// iova (CAP_NET_ADMIN only, older kernels).
    pub iova: Option<u64>,
    /// MR number.
    pub mrn: Option<u32>,
    /// PD number.
    pub pdn: Option<u32>,
}

fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

/// Netlink attributes of `buf`: `(type, payload)`; a malformed tail ends the walk.
fn attrs(mut buf: &[u8]) -> Vec<(u16, &[u8])> {
    let mut out = Vec::new();
    while buf.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([buf[0], buf[1]]));
        let ty = u16::from_ne_bytes([buf[2], buf[3]]) & NLA_TYPE_MASK;
        if len < 4 || len > buf.len() {
            break;
        }
        out.push((ty, &buf[4..len]));
        buf = &buf[align4(len).min(buf.len())..];
    }
    out
}

fn u32_of(b: &[u8]) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(..4)?.try_into().ok()?))
}

fn u64_of(b: &[u8]) -> Option<u64> {
    Some(u64::from_ne_bytes(b.get(..8)?.try_into().ok()?))
}

fn str_of(b: &[u8]) -> String {
    String::from_utf8_lossy(b.split(|c| *c == 0).next().unwrap_or(b)).into_owned()
}

/// The netlink messages of a reply datagram: `(type, payload)`; an `NLMSG_ERROR` with a
/// non-zero code becomes `Err(errno)`.
pub fn messages(mut buf: &[u8]) -> Result<Vec<(u16, &[u8])>, i32> {
    let mut out = Vec::new();
    while buf.len() >= 16 {
        let len = u32_of(buf).unwrap_or(0) as usize;
        let ty = u16::from_ne_bytes([buf[4], buf[5]]);
        if len < 16 || len > buf.len() {
            break;
        }
        let payload = &buf[16..len];
        if ty == NLMSG_ERROR {
            let code = payload
                .get(..4)
                .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                .unwrap_or(0);
            if code != 0 {
                return Err(-code);
            }
        } else {
            out.push((ty, payload));
        }
        buf = &buf[align4(len).min(buf.len())..];
    }
    Ok(out)
}

/// The MRs in the payload of one `RES_MR_GET` reply message.
pub fn parse_mr_reply(payload: &[u8]) -> Vec<KernelMr> {
    let top = attrs(payload);
    let dev = top
        .iter()
        .find(|(t, _)| *t == attr::DEV_NAME)
        .map(|(_, v)| str_of(v))
        .unwrap_or_default();
    let mut out = Vec::new();
    for (_, table) in top.iter().filter(|(t, _)| *t == attr::RES_MR) {
        for (_, entry) in attrs(table)
            .into_iter()
            .filter(|(t, _)| *t == attr::RES_MR_ENTRY)
        {
            let mut m = KernelMr {
                dev: dev.clone(),
                ..KernelMr::default()
            };
            for (t, v) in attrs(entry) {
                match t {
                    attr::RES_PID => m.pid = u32_of(v),
                    attr::RES_KERN_NAME => m.kern_name = Some(str_of(v)),
                    attr::RES_MRLEN => m.length = u64_of(v),
                    attr::RES_LKEY => m.lkey = u32_of(v),
                    attr::RES_RKEY => m.rkey = u32_of(v),
                    attr::RES_IOVA => m.iova = u64_of(v),
                    attr::RES_MRN => m.mrn = u32_of(v),
                    attr::RES_PDN => m.pdn = u32_of(v),
                    _ => {}
                }
            }
            out.push(m);
        }
    }
    out
}

/// A request: header + optional u32 `DEV_INDEX` attribute.
pub fn request(op: u16, seq: u32, dev_index: Option<u32>) -> Vec<u8> {
    let mut b = vec![0u8; 16];
    if let Some(i) = dev_index {
        b.extend_from_slice(&8u16.to_ne_bytes());
        b.extend_from_slice(&attr::DEV_INDEX.to_ne_bytes());
        b.extend_from_slice(&i.to_ne_bytes());
    }
    let len = b.len() as u32;
    b[0..4].copy_from_slice(&len.to_ne_bytes());
    b[4..6].copy_from_slice(&msg_type(op).to_ne_bytes());
    b[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    b[8..12].copy_from_slice(&seq.to_ne_bytes());
    b
}

/// Send one dump request and collect every reply payload until `NLMSG_DONE`.
fn dump(fd: &std::os::fd::OwnedFd, req: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    use rustix::net::netlink::SocketAddrNetlink;
    use rustix::net::{recv, sendto, RecvFlags, SendFlags};
    sendto(fd, req, SendFlags::empty(), &SocketAddrNetlink::new(0, 0))
        .map_err(|e| format!("sending the request failed: {e}"))?;
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 << 10];
    // Bounded: at most 10 000 datagrams (the socket has a receive timeout).
    for _ in 0..10_000 {
        let (n, _) = recv(fd, &mut buf[..], RecvFlags::empty())
            .map_err(|e| format!("reading the reply failed: {e}"))?;
        let msgs = messages(&buf[..n.min(buf.len())]).map_err(|errno| {
            format!(
                "the kernel refused the request: {}",
                std::io::Error::from_raw_os_error(errno)
            )
        })?;
        for (ty, p) in msgs {
            if ty == NLMSG_DONE {
                return Ok(out);
            }
            out.push(p.to_vec());
        }
    }
    Err("the reply did not end".into())
}

/// Every MR on every kernel RDMA device, or a sentence saying why the kernel offers no dump.
pub fn kernel_mrs() -> Result<Vec<KernelMr>, String> {
    use rustix::net::{netlink, socket, sockopt, AddressFamily, SocketType};
    let fd = socket(AddressFamily::NETLINK, SocketType::RAW, Some(netlink::RDMA)).map_err(|e| {
        format!("the kernel has no RDMA netlink (socket(AF_NETLINK, NETLINK_RDMA) failed: {e}): it offers no resource dump, so only mrkit processes' own statistics can be shown")
    })?;
    let _ = sockopt::set_socket_timeout(&fd, sockopt::Timeout::Recv, Some(Duration::from_secs(2)));
    let devs = dump(&fd, &request(CMD_GET, 1, None)).map_err(|e| {
        format!("the kernel's RDMA netlink does not answer the device list ({e}): no resource dump here")
    })?;
    let mut list: Vec<(u32, String)> = devs
        .iter()
        .filter_map(|p| {
            let a = attrs(p);
            let i = a
                .iter()
                .find(|(t, _)| *t == attr::DEV_INDEX)
                .and_then(|(_, v)| u32_of(v))?;
            let n = a
                .iter()
                .find(|(t, _)| *t == attr::DEV_NAME)
                .map(|(_, v)| str_of(v))?;
            Some((i, n))
        })
        .collect();
    list.sort();
    list.dedup();
    if list.is_empty() {
        return Err(
            "the kernel has no RDMA device (the RDMA netlink lists none): nothing to dump".into(),
        );
    }
    let mut out = Vec::new();
    for (seq, (i, name)) in list.iter().enumerate() {
        let replies = dump(&fd, &request(CMD_RES_MR_GET, seq as u32 + 2, Some(*i)))
            .map_err(|e| format!("{name}: {e}"))?;
        for p in replies {
            out.extend(parse_mr_reply(&p));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One attribute, padded.
    fn nla(ty: u16, payload: &[u8]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
        b.extend_from_slice(&ty.to_ne_bytes());
        b.extend_from_slice(payload);
        b.resize(align4(b.len()), 0);
        b
    }

    /// A recorded-shape reply: one RES_MR_GET message for mlx5_0 with a user MR (keys, as
    /// for CAP_NET_ADMIN) and a kernel MR, then NLMSG_DONE.
    fn reply() -> Vec<u8> {
        let user = [
            nla(attr::RES_RKEY, &0x1234u32.to_ne_bytes()),
            nla(attr::RES_LKEY, &0x1234u32.to_ne_bytes()),
            nla(attr::RES_MRLEN, &65536u64.to_ne_bytes()),
            nla(attr::RES_MRN, &7u32.to_ne_bytes()),
            nla(attr::RES_PDN, &3u32.to_ne_bytes()),
            nla(attr::RES_PID, &4242u32.to_ne_bytes()),
            nla(0x3fff, b"future attribute"),
        ]
        .concat();
        let kern = [
            nla(attr::RES_MRLEN, &4096u64.to_ne_bytes()),
            nla(attr::RES_KERN_NAME, b"nvme_rdma\0"),
        ]
        .concat();
        // Nested attributes carry NLA_F_NESTED (0x8000) in real replies.
        let table = [
            nla(attr::RES_MR_ENTRY | 0x8000, &user),
            nla(attr::RES_MR_ENTRY | 0x8000, &kern),
        ]
        .concat();
        let payload = [
            nla(attr::DEV_INDEX, &1u32.to_ne_bytes()),
            nla(attr::DEV_NAME, b"mlx5_0\0"),
            nla(attr::RES_MR | 0x8000, &table),
        ]
        .concat();
        let mut msg = Vec::new();
        let mut hdr = |ty: u16, body: &[u8]| {
            msg.extend_from_slice(&((16 + body.len()) as u32).to_ne_bytes());
            msg.extend_from_slice(&ty.to_ne_bytes());
            msg.extend_from_slice(&2u16.to_ne_bytes());
            msg.extend_from_slice(&[0u8; 8]);
            msg.extend_from_slice(body);
        };
        hdr(msg_type(CMD_RES_MR_GET), &payload);
        hdr(NLMSG_DONE, &0u32.to_ne_bytes());
        msg
    }

    #[test]
    fn parses_a_recorded_mr_dump() {
        let r = reply();
        let msgs = messages(&r).unwrap();
        assert_eq!(msgs.len(), 2);
        assert_eq!(msgs[0].0, (5 << 10) + 13);
        assert_eq!(msgs[1].0, NLMSG_DONE);
        let mrs = parse_mr_reply(msgs[0].1);
        assert_eq!(
            mrs,
            vec![
                KernelMr {
                    dev: "mlx5_0".into(),
                    pid: Some(4242),
                    length: Some(65536),
                    lkey: Some(0x1234),
                    rkey: Some(0x1234),
                    mrn: Some(7),
                    pdn: Some(3),
                    ..KernelMr::default()
                },
                KernelMr {
                    dev: "mlx5_0".into(),
                    kern_name: Some("nvme_rdma".into()),
                    length: Some(4096),
                    ..KernelMr::default()
                },
            ]
        );
    }

    #[test]
    fn hostile_bytes_never_panic() {
        let r = reply();
        for cut in 0..r.len() {
            if let Ok(m) = messages(&r[..cut]) {
                for (_, p) in m {
                    let _ = parse_mr_reply(p);
                }
            }
            let _ = parse_mr_reply(&r[..cut]);
        }
        // An error message carries -errno.
        let mut e = Vec::new();
        e.extend_from_slice(&20u32.to_ne_bytes());
        e.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        e.extend_from_slice(&[0u8; 10]);
        e.extend_from_slice(&(-95i32).to_ne_bytes());
        assert_eq!(messages(&e), Err(95));
    }

    #[test]
    fn request_layout() {
        let r = request(CMD_RES_MR_GET, 9, Some(3));
        assert_eq!(r.len(), 24);
        assert_eq!(u32_of(&r).unwrap(), 24);
        assert_eq!(u16::from_ne_bytes([r[4], r[5]]), (5 << 10) + 13);
        assert_eq!(u16::from_ne_bytes([r[6], r[7]]), 0x301);
        assert_eq!(
            attrs(&r[16..]),
            vec![(attr::DEV_INDEX, &3u32.to_ne_bytes()[..])]
        );
    }

    /// Here the kernel has no RDMA: the dump fails with a sentence, never a panic or a hang.
    #[test]
    fn no_kernel_rdma_fails_cleanly() {
        let has_rdma = std::path::Path::new("/sys/class/infiniband")
            .read_dir()
            .is_ok_and(|mut d| d.next().is_some());
        match kernel_mrs() {
            Ok(mrs) => assert!(has_rdma, "a dump without kernel RDMA devices: {mrs:?}"),
            Err(e) => assert!(e.contains("RDMA") && e.len() > 40, "{e}"),
        }
    }
}
