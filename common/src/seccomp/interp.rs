//! A classic-BPF interpreter for the subset seccomp filters use, so that the programs for
//! an architecture we are not running on can be checked decision by decision.

use seccompiler::sock_filter;

/// The fields of `struct seccomp_data` a filter can read.
pub struct Data {
    pub nr: u32,
    pub arch: u32,
    pub args: [u64; 6],
}

impl Data {
    fn word(&self, offset: u32) -> u32 {
        match offset {
            0 => self.nr,
            4 => self.arch,
            8 | 12 => 0, // instruction pointer: no rule reads it
            16..=63 if offset % 4 == 0 => {
                let arg = self.args[((offset - 16) / 8) as usize];
                if (offset - 16) % 8 == 0 { arg as u32 } else { (arg >> 32) as u32 }
            }
            other => panic!("filter reads seccomp_data at offset {other}"),
        }
    }
}

/// Runs `program` on `data` and returns the action word, as the kernel would.
pub fn run(program: &[sock_filter], data: &Data) -> u32 {
    let mut acc: u32 = 0;
    let mut pc = 0usize;
    loop {
        let insn = program.get(pc).unwrap_or_else(|| panic!("fell off the program at {pc}"));
        pc += 1;
        let class = insn.code & 0x07;
        match (class, insn.code) {
            (0x00, 0x20) => acc = data.word(insn.k), // ld w abs
            (0x04, 0x54) => acc &= insn.k,           // alu and k
            (0x05, 0x05) => pc += insn.k as usize,   // ja
            (0x05, code) => {
                let taken = match code & 0xf0 {
                    0x10 => acc == insn.k,     // jeq
                    0x20 => acc > insn.k,      // jgt
                    0x30 => acc >= insn.k,     // jge
                    0x40 => acc & insn.k != 0, // jset
                    other => panic!("unsupported jump op {other:#x}"),
                };
                pc += usize::from(if taken { insn.jt } else { insn.jf });
            }
            (0x06, 0x06) => return insn.k, // ret k
            _ => panic!("unsupported instruction {:#06x}", insn.code),
        }
    }
}
