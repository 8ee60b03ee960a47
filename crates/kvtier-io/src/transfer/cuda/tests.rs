//! Unit tests of the CUDA mover's planning (no GPU needed) and its clean failure without a driver.
#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn coalesce_merges_only_contiguous_runs() {
    let v = vec![
        Copy {
            src: 0,
            dst: 100,
            len: 10,
        },
        Copy {
            src: 10,
            dst: 110,
            len: 10,
        },
        Copy {
            src: 20,
            dst: 200,
            len: 10,
        },
        Copy {
            src: 30,
            dst: 210,
            len: 5,
        },
    ];
    assert_eq!(
        coalesce(v),
        vec![
            Copy {
                src: 0,
                dst: 100,
                len: 20
            },
            Copy {
                src: 20,
                dst: 200,
                len: 15
            }
        ]
    );
}

#[test]
fn flatten_places_chunks_in_canonical_order() {
    let items = vec![(
        0usize,
        vec![Chunk { addr: 1000, len: 4 }, Chunk { addr: 5000, len: 6 }],
        64usize,
    )];
    let f = flatten(&items, CopyDir::DeviceToHost);
    assert_eq!(
        f,
        vec![
            Copy {
                src: 1000,
                dst: 64,
                len: 4
            },
            Copy {
                src: 5000,
                dst: 68,
                len: 6
            }
        ]
    );
    let b = flatten(&items, CopyDir::HostToDevice);
    assert_eq!(
        b[1],
        Copy {
            src: 68,
            dst: 5000,
            len: 6
        }
    );
}

#[test]
fn a_round_places_each_blocks_chunks_in_its_staging_slot() {
    // Two blocks of 10 bytes (chunks of 4 + 6), host blocks contiguous at 640 and 650.
    let items = vec![
        (
            0usize,
            vec![Chunk { addr: 1000, len: 4 }, Chunk { addr: 5000, len: 6 }],
            640usize,
        ),
        (
            1usize,
            vec![Chunk { addr: 2000, len: 4 }, Chunk { addr: 6000, len: 6 }],
            650usize,
        ),
    ];
    let (d, copies) = round(&items, 100, 10, CopyDir::DeviceToHost);
    // Gather: engine chunk -> slot k of the half at 100, in canonical order.
    assert_eq!(
        d,
        vec![1000, 100, 4, 5000, 104, 6, 2000, 110, 4, 6000, 114, 6]
    );
    // The two slots and the two host blocks are both contiguous: one copy.
    assert_eq!(
        copies,
        vec![Copy {
            src: 100,
            dst: 640,
            len: 20
        }]
    );
    let (d, copies) = round(&items, 100, 10, CopyDir::HostToDevice);
    assert_eq!(&d[..6], &[100, 1000, 4, 104, 5000, 6]);
    assert_eq!(
        copies,
        vec![Copy {
            src: 640,
            dst: 100,
            len: 20
        }]
    );
}

/// Compiles the gather/scatter kernel where NVRTC is installed (no GPU needed).
#[test]
fn kernel_compiles_with_nvrtc() {
    if !cu::nvrtc_present() {
        eprintln!("NVRTC not installed: skipping");
        return;
    }
    let ptx = cudarc::nvrtc::compile_ptx(KERNEL_SRC).unwrap();
    assert!(ptx.to_src().contains(".entry kvtier_copy_chunks("));
    // The embedded fallback is the same compiler output (modulo its header comment).
    let body = |p: &str| {
        p.lines()
            .filter(|l| !l.starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n")
    };
    assert_eq!(
        body(&ptx.to_src()),
        body(KERNEL_PTX),
        "regenerate copy_kernel.ptx"
    );
    if let Ok(p) = std::env::var("KVTIER_DUMP_PTX") {
        std::fs::write(p, ptx.to_src()).unwrap();
    }
}

#[test]
fn cuda_engine_without_driver_is_a_clean_error() {
    if cu::library_present() {
        eprintln!("CUDA present: skipping the no-driver check");
        return;
    }
    let l = crate::StridedLayout::contiguous(crate::DevicePtr::new(4096).unwrap(), 2, 64).unwrap();
    let r = CudaMover::new(0, &l, None, CudaCopyMethod::Auto, LayeredCopy::Auto);
    assert!(matches!(r, Err(IoError::Cuda(_))));
}
