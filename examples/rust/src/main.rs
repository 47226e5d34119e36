//! og_decode — greedy decoding from a packed model file through the onegraph C ABI (std only).
//!
//!     cargo build --offline --release   (in examples/rust; the library: `python build.py`)
//!     target/release/og_decode [--kv int8|bf16|fp32] [--max-seq-len N] FILE N ID [ID ...]
//!
//! The twin of examples/c/decode.c: feeds the prompt, chooses N tokens greedily (the last
//! one is not fed back), prints them on one line on stdout and the timing on stderr.
//! Exit status: 0 done, 1 a library error, 2 usage, 3 no CUDA device.
mod ffi;

use std::ffi::{CStr, CString};
use std::process::ExitCode;
use std::time::Instant;

/// A failed library call: which call, its status and og_last_error().
struct Error {
    call: &'static str,
    status: ffi::og_status,
    message: String,
}

fn last_error() -> String {
    // SAFETY: og_last_error never returns NULL; the string is valid until the next call.
    unsafe { CStr::from_ptr(ffi::og_last_error()) }.to_string_lossy().into_owned()
}

fn check(call: &'static str, status: ffi::og_status) -> Result<(), Error> {
    if status == ffi::OG_OK {
        Ok(())
    } else {
        Err(Error { call, status, message: last_error() })
    }
}

/// An engine opened from a packed file, its steps taking the greedy token on the device
/// (og_set_output: each step copies 8 bytes to the host, not the logits); og_free on drop.
struct Engine {
    handle: *mut ffi::og_engine,
}

impl Engine {
    fn open(path: &str, kv: i32, max_seq_len: i32) -> Result<Engine, Error> {
        let c_path = CString::new(path).map_err(|_| Error {
            call: "og_open_packed",
            status: ffi::OG_E_INVALID_ARGUMENT,
            message: format!("{path:?} contains a NUL byte"),
        })?;
        let mut handle = std::ptr::null_mut();
        // SAFETY: c_path outlives the call; handle is written only on success.
        check("og_open_packed", unsafe { ffi::og_open_packed(c_path.as_ptr(), kv, max_seq_len, &mut handle) })?;
        let engine = Engine { handle };
        // SAFETY: handle is a live engine (dropped, and freed, if this fails).
        check("og_set_output", unsafe { ffi::og_set_output(engine.handle, ffi::OG_OUTPUT_NEXT_TOKEN) })?;
        Ok(engine)
    }

    /// Feed one token.
    fn step(&mut self, token: i32) -> Result<(), Error> {
        // SAFETY: handle is live; a NULL logits pointer is allowed.
        check("og_step", unsafe { ffi::og_step(self.handle, token, std::ptr::null_mut()) })
    }

    /// The greedy token after the last step (its argmax, taken on the device).
    fn greedy(&self) -> Result<i32, Error> {
        let (mut token, mut logit) = (0, 0.0f32);
        // SAFETY: handle is live; both pointers are to locals.
        check("og_next_token", unsafe { ffi::og_next_token(self.handle, &mut token, &mut logit) })?;
        if logit.is_nan() {  // no token to choose (og_argmax refuses NaN logits too)
            return Err(Error { call: "og_next_token", status: ffi::OG_E_INVALID_ARGUMENT,
                               message: "the logits contain NaN".into() });
        }
        Ok(token)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // SAFETY: handle came from og_open_packed and is freed once.
        unsafe { ffi::og_free(self.handle) };
    }
}

const USAGE: &str = "usage: og_decode [--kv int8|bf16|fp32] [--max-seq-len N] FILE N ID [ID ...]\n  \
    FILE  a packed model file (onegraph pack --model DIR --out FILE)\n  \
    N     new tokens to generate greedily\n  \
    ID    prompt token ids";

fn parse_int(text: &str, what: &str, min: i32) -> Result<i32, ExitCode> {
    match text.parse::<i32>() {
        Ok(v) if v >= min => Ok(v),
        _ => {
            eprintln!("og_decode: {what} must be an integer >= {min}, got '{text}'");
            Err(ExitCode::from(2))
        }
    }
}

fn run() -> Result<(), ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut kv, mut max_seq_len, mut i) = (ffi::OG_KV_INT8, 4096, 0);
    let usage = || {
        eprintln!("{USAGE}");
        ExitCode::from(2)
    };
    while i < args.len() && args[i].starts_with("--") {
        let value = args.get(i + 1).ok_or_else(usage)?;
        match args[i].as_str() {
            "--kv" => {
                kv = match value.as_str() {
                    "int8" => ffi::OG_KV_INT8,
                    "bf16" => ffi::OG_KV_BF16,
                    "fp32" => ffi::OG_KV_F32,
                    _ => return Err(usage()),
                }
            }
            "--max-seq-len" => max_seq_len = parse_int(value, "--max-seq-len", 1)?,
            _ => return Err(usage()),
        }
        i += 2;
    }
    if args.len() < i + 3 {
        return Err(usage());
    }
    let path = &args[i];
    let n_new = parse_int(&args[i + 1], "N", 0)?;
    let prompt = args[i + 2..].iter().map(|t| parse_int(t, "a prompt id", 0)).collect::<Result<Vec<_>, _>>()?;

    // SAFETY: plain calls without pointers, or with a pointer to a local.
    let version = unsafe { ffi::og_abi_version() };
    if version != ffi::OG_ABI_VERSION {
        eprintln!("og_decode: the library has ABI version {version}, this program was built for {}", ffi::OG_ABI_VERSION);
        return Err(ExitCode::from(1));
    }
    let mut devices = 0;
    if unsafe { ffi::og_device_count(&mut devices) } != ffi::OG_OK || devices < 1 {
        let why = last_error();
        let prefix = if why.starts_with("no CUDA device") { "" } else { "no CUDA device: " };
        eprintln!("og_decode: {prefix}{why}");
        return Err(ExitCode::from(3));
    }

    let report = |e: Error| {
        eprintln!("og_decode: {} failed (status {}): {}", e.call, e.status, e.message);
        ExitCode::from(1)
    };
    let t_open = Instant::now();
    let mut engine = Engine::open(path, kv, max_seq_len).map_err(report)?;
    let t_start = Instant::now();
    let mut steps = 0;
    let mut generated = Vec::with_capacity(n_new as usize);
    for &token in &prompt {
        engine.step(token).map_err(report)?;
        steps += 1;
    }
    while generated.len() < n_new as usize {
        let token = engine.greedy().map_err(report)?;
        generated.push(token);
        if generated.len() < n_new as usize {
            engine.step(token).map_err(report)?;
            steps += 1;
        }
    }
    let seconds = t_start.elapsed().as_secs_f64();
    let line: Vec<String> = generated.iter().map(|t| t.to_string()).collect();
    println!("{}", line.join(" "));
    eprintln!(
        "og_decode: open {:.1} ms; {} steps ({} prompt + {} new) in {:.1} ms: {:.1} tok/s",
        1e3 * (t_start - t_open).as_secs_f64(),
        steps,
        prompt.len(),
        n_new,
        1e3 * seconds,
        if seconds > 0.0 { steps as f64 / seconds } else { 0.0 }
    );
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(code) => code,
    }
}
