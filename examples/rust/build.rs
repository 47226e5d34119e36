//! Link against libonegraph.so: runtime/_lib of this repository (built by `python build.py`),
//! or $ONEGRAPH_LIB_DIR. The folder also goes into the binary's rpath, so the program runs
//! without LD_LIBRARY_PATH.
use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-env-changed=ONEGRAPH_LIB_DIR");
    let lib_dir = match env::var_os("ONEGRAPH_LIB_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
            .join("../../runtime/_lib"),
    };
    let lib_dir = lib_dir.canonicalize().unwrap_or(lib_dir);
    println!("cargo:rerun-if-changed={}", lib_dir.join("libonegraph.so").display());
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=onegraph");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
}
