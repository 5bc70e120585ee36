//! The answer of a synchronous execution, streamed (issue #14 hole 4): the result's JSON is
//! escaped piece by piece as the client reads it, straight from the kept output, so the
//! answer costs no copy of the output (never a `String` of the whole answer, never a
//! `serde_json::Value` tree). The output's memory stays counted in the server-wide pool
//! until the answer has been read to its end or the client is gone.
//!
//! The JSON is exactly what `serde_json::to_string(&result)` writes, plus the `\n` every
//! answer ends with: the fields other than `stdout` and `stderr` are serialized by serde
//! (with the two left empty), and the two are written in between.

use std::collections::VecDeque;
use std::io::{self, Read};

use super::stream::Download;
use crate::exec::ExecutionResult;
use crate::launch::output::{escaped, json_len};
use crate::launch::{OutputText, Piece};

#[derive(Debug)]
enum Part {
    Json(Vec<u8>),
    Text(Piece),
}

/// A `Read` of one answer's JSON text.
#[derive(Debug)]
pub struct Answer {
    parts: VecDeque<Part>,
    /// Position in the front part.
    pos: usize,
    /// Bytes of an escape that did not fit the caller's buffer.
    stash: ([u8; 6], usize, usize),
    /// The output texts, holding their memory from the pool until the answer ends.
    _held: [OutputText; 2],
    len: u64,
}

impl Answer {
    pub fn new(mut result: ExecutionResult) -> Result<Answer, serde_json::Error> {
        let mut stdout = std::mem::take(&mut result.stdout);
        let mut stderr = std::mem::take(&mut result.stderr);
        let json = serde_json::to_string(&result)?;
        let head = format!("{{\"exitCode\":{},\"stdout\":\"", result.exit_code);
        let expected = format!("{head}\",\"stderr\":\"\",");
        let Some(rest) = json.strip_prefix(&expected) else {
            // Not the field order this module knows: the whole answer at once.
            result.stdout = stdout;
            result.stderr = stderr;
            let mut all = serde_json::to_vec(&result)?;
            all.push(b'\n');
            let len = all.len() as u64;
            let parts = VecDeque::from([Part::Json(all)]);
            return Ok(Answer { parts, pos: 0, stash: ([0; 6], 0, 0), _held: Default::default(), len });
        };
        let middle = b"\",\"stderr\":\"".to_vec();
        let end = format!("\",{rest}\n").into_bytes();
        let len = (head.len() + stdout.json_len() + middle.len() + stderr.json_len() + end.len()) as u64;
        let mut parts = VecDeque::new();
        parts.push_back(Part::Json(head.into_bytes()));
        parts.extend(stdout.take_pieces().into_iter().map(Part::Text));
        parts.push_back(Part::Json(middle));
        parts.extend(stderr.take_pieces().into_iter().map(Part::Text));
        parts.push_back(Part::Json(end));
        Ok(Answer { parts, pos: 0, stash: ([0; 6], 0, 0), _held: [stdout, stderr], len })
    }

    /// The answer as a streamed JSON body.
    pub fn into_download(self) -> Download {
        let len = self.len;
        Download::from_reader(self, Some(len)).json()
    }
}

impl Read for Answer {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let mut n = 0;
        let (bytes, from, to) = &mut self.stash;
        if *from < *to {
            let k = (*to - *from).min(buf.len());
            buf[..k].copy_from_slice(&bytes[*from..*from + k]);
            *from += k;
            n = k;
        }
        while n < buf.len() {
            let Some(part) = self.parts.front() else { break };
            let done = match part {
                Part::Json(bytes) => {
                    let k = (bytes.len() - self.pos).min(buf.len() - n);
                    buf[n..n + k].copy_from_slice(&bytes[self.pos..self.pos + k]);
                    n += k;
                    self.pos += k;
                    self.pos == bytes.len()
                }
                Part::Text(piece) => {
                    let text = piece.as_str().as_bytes();
                    while self.pos < text.len() && n < buf.len() {
                        // A run of bytes that need no escape is copied as it is.
                        let plain = text[self.pos..]
                            .iter()
                            .take(buf.len() - n)
                            .take_while(|b| json_len(**b) == 1)
                            .count();
                        if plain > 0 {
                            buf[n..n + plain].copy_from_slice(&text[self.pos..self.pos + plain]);
                            (n, self.pos) = (n + plain, self.pos + plain);
                            continue;
                        }
                        let (e, len) = escaped(text[self.pos]);
                        self.pos += 1;
                        let k = len.min(buf.len() - n);
                        buf[n..n + k].copy_from_slice(&e[..k]);
                        n += k;
                        if k < len {
                            self.stash = (e, k, len);
                        }
                    }
                    self.pos == text.len()
                }
            };
            if done {
                // Each piece's memory goes as soon as it is written.
                self.parts.pop_front();
                self.pos = 0;
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::{OutputBudget, Stream};

    fn result(stdout: OutputText, stderr: OutputText) -> ExecutionResult {
        ExecutionResult {
            exit_code: 3,
            stdout,
            stderr,
            cgroup_mode: "none",
            created_files: vec!["a\"b".into()],
            modified_files: vec![],
            environment_revision_id: "rev".into(),
            environment_variables: crate::exec::OrderedMap(vec![("K".into(), "v\u{1}".into())]),
            execution_id: "id".into(),
            finished_at: "t".into(),
            kernel_id: "ephemeral:id".into(),
            kernel_mode: "ephemeral",
            language: "shell",
            network_access_revision: "r".into(),
            network_policy: "none".into(),
            runner_version: "v",
            sandbox: "bubblewrap",
            started_at: "s".into(),
            working_directory: "/workspace".into(),
            limits: crate::limits::outcome_fields(
                crate::launch::Termination::Exited(3),
                false,
                None,
                &crate::limits::Limits { memory_bytes: 1, pids: 2, cpu_millicores: 500, tmp_bytes: 3 },
                &[],
                crate::limits::Mode::RlimitsOnly,
            ),
            workspace_snapshot: Some(serde_json::json!({"digest": "sha256:x"})),
        }
    }

    fn read_all(mut answer: Answer, chunk: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let mut buf = vec![0u8; chunk];
        loop {
            let n = answer.read(&mut buf).unwrap();
            if n == 0 {
                return out;
            }
            out.extend_from_slice(&buf[..n]);
        }
    }

    #[test]
    fn the_streamed_answer_is_serde_jsons_text() {
        let mut b = OutputBudget::new(5000);
        let data: Vec<u8> = (0..20_000u32).map(|i| (i % 256) as u8).collect();
        b.push(Stream::Stdout, &data);
        b.push(Stream::Stderr, "训练中 \"quoted\" \\ \u{7}".as_bytes());
        let text = b.finish_text();
        let (out, err) = (text.stdout.to_string(), text.stderr.to_string());
        let want = serde_json::to_string(&result(out.into(), err.into())).unwrap() + "\n";
        for chunk in [1, 5, 6, 7, 4096] {
            let mut b = OutputBudget::new(5000);
            b.push(Stream::Stdout, &data);
            b.push(Stream::Stderr, "训练中 \"quoted\" \\ \u{7}".as_bytes());
            let text = b.finish_text();
            let answer = Answer::new(result(text.stdout, text.stderr)).unwrap();
            assert_eq!(answer.len, want.len() as u64, "{chunk}");
            let got = read_all(answer, chunk);
            assert_eq!(String::from_utf8(got).unwrap(), want, "{chunk}");
        }
    }
}
