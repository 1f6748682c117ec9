// Command image builds kettlefleet's OCI image without a daemon, from the
// static binaries of `make release`: one image per architecture in one
// index, written as an OCI image layout (a directory any registry client
// can push: `skopeo copy oci:dist/oci docker://…`, `crane push`).
//
// The same inputs give the same digest: every file's time is the commit's
// (--epoch), owners are fixed, entries sorted, the config's creation time
// is the commit's, and the SBOM is derived from the binary alone.
//
// Each image holds the binary (/usr/bin/kettle), the host's CA bundle and
// time zone database (Debian ca-certificates, tzdata), a non-root user
// (kettle, 65532), /data as the volume (the store and the generated
// secrets), and a CycloneDX SBOM of the Go modules compiled into the
// binary (read from its build information) at
// /usr/share/doc/kettle/sbom.cdx.json, also written beside the layout.
package main

import (
	"archive/tar"
	"bytes"
	"debug/buildinfo"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	cdx "github.com/CycloneDX/cyclonedx-go"
	"github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/google/uuid"
)

// uid and gid of the image's user: above any distribution's system range,
// the value distroless images use.
const uid = 65532

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "image:", err)
		os.Exit(1)
	}
}

type options struct {
	bins     map[string]string // GOARCH → static binary
	out      string
	version  string
	revision string
	source   string
	epoch    time.Time
	caFile   string
	zoneinfo string
}

func run(args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	amd64 := fs.String("amd64", "", "static linux/amd64 kettle binary (make release: dist/kettle_linux_amd64)")
	arm64 := fs.String("arm64", "", "static linux/arm64 kettle binary (empty: an amd64-only image)")
	out := fs.String("out", "dist/oci", "OCI image layout directory to write (replaced)")
	version := fs.String("version", "dev", "org.opencontainers.image.version")
	revision := fs.String("revision", "unknown", "org.opencontainers.image.revision (the commit)")
	source := fs.String("source", "https://github.com/kettlefleet/kettlefleet", "org.opencontainers.image.source")
	epoch := fs.Int64("epoch", 0, "every time in the image, as Unix seconds (the commit's time: reproducible)")
	ca := fs.String("ca-file", "/etc/ssl/certs/ca-certificates.crt", "CA bundle to ship (Debian ca-certificates)")
	zi := fs.String("zoneinfo", "/usr/share/zoneinfo", "time zone database to ship (Debian tzdata)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	o := options{bins: map[string]string{}, out: *out, version: *version, revision: *revision, source: *source,
		epoch: time.Unix(*epoch, 0).UTC(), caFile: *ca, zoneinfo: *zi}
	if *amd64 == "" {
		return errors.New("--amd64 is required")
	}
	o.bins["amd64"] = *amd64
	if *arm64 != "" {
		o.bins["arm64"] = *arm64
	}
	idx, sbom, err := build(o)
	if err != nil {
		return err
	}
	if err := os.RemoveAll(o.out); err != nil {
		return err
	}
	p, err := layout.Write(o.out, idx)
	if err != nil {
		return fmt.Errorf("write %s: %w", o.out, err)
	}
	_ = p
	if err := os.WriteFile(o.out+".cdx.json", sbom, 0o644); err != nil {
		return err
	}
	d, err := idx.Digest()
	if err != nil {
		return err
	}
	fmt.Printf("index %s %s\n", d, o.out)
	m, err := idx.IndexManifest()
	if err != nil {
		return err
	}
	for _, desc := range m.Manifests {
		fmt.Printf("image %s %s/%s\n", desc.Digest, desc.Platform.OS, desc.Platform.Architecture)
	}
	return nil
}

// build returns the index of one image per binary and the SBOM (of the
// amd64 binary: every architecture compiles the same modules).
func build(o options) (v1.ImageIndex, []byte, error) {
	sbom, err := sbomOf(o.bins["amd64"], o)
	if err != nil {
		return nil, nil, err
	}
	var idx v1.ImageIndex = empty.Index
	idx = mutate.IndexMediaType(idx, types.OCIImageIndex)
	arches := make([]string, 0, len(o.bins))
	for a := range o.bins {
		arches = append(arches, a)
	}
	sort.Strings(arches)
	for _, arch := range arches {
		img, err := imageFor(arch, o.bins[arch], sbom, o)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", arch, err)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{Add: img,
			Descriptor: v1.Descriptor{Platform: &v1.Platform{OS: "linux", Architecture: arch}}})
	}
	return idx, sbom, nil
}

func imageFor(arch, bin string, sbom []byte, o options) (v1.Image, error) {
	layerTar, err := rootfs(bin, sbom, o)
	if err != nil {
		return nil, err
	}
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(layerTar)), nil
	}, tarball.WithMediaType(types.OCILayer), tarball.WithCompressedCaching)
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{Layer: layer, History: v1.History{
		Created: v1.Time{Time: o.epoch}, CreatedBy: "deploy/dist/cmd/image", Comment: "kettle " + o.version}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", arch
	cf.Created = v1.Time{Time: o.epoch}
	cf.Config = v1.Config{
		User:       fmt.Sprintf("%d:%d", uid, uid),
		Entrypoint: []string{"/usr/bin/kettle"},
		Cmd:        []string{"serve"},
		WorkingDir: "/data",
		// The settings a container needs: listen beyond its own loopback,
		// keep the store and the generated secrets on the volume.
		Env: []string{
			"PATH=/usr/bin:/bin",
			"KETTLE_ADDR=0.0.0.0:8080",
			"KETTLE_DATA_DIR=/data",
			"KETTLE_DB=sqlite:/data/kettle.db",
			"KETTLE_LOG_FORMAT=json",
			"SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt",
			"ZONEINFO=/usr/share/zoneinfo",
		},
		ExposedPorts: map[string]struct{}{"8080/tcp": {}, "1883/tcp": {}},
		Volumes:      map[string]struct{}{"/data": {}},
		StopSignal:   "SIGTERM",
		Labels: map[string]string{
			"org.opencontainers.image.title":       "kettlefleet",
			"org.opencontainers.image.description": "kettle serve: the kettlefleet backend, and the lab that proves it",
			"org.opencontainers.image.source":      o.source,
			"org.opencontainers.image.revision":    o.revision,
			"org.opencontainers.image.version":     o.version,
			"org.opencontainers.image.created":     o.epoch.Format(time.RFC3339),
			"dev.kettlefleet.sbom":                 "/usr/share/doc/kettle/sbom.cdx.json",
		},
	}
	return mutate.ConfigFile(img, cf)
}

// entry is one file of the image's root filesystem.
type entry struct {
	name string
	mode int64
	uid  int
	dir  bool
	body []byte
}

// rootfs is the image's one layer, as an uncompressed tar: sorted, every
// time the epoch, owners numeric.
func rootfs(bin string, sbom []byte, o options) ([]byte, error) {
	b, err := os.ReadFile(bin)
	if err != nil {
		return nil, err
	}
	ca, err := os.ReadFile(o.caFile)
	if err != nil {
		return nil, fmt.Errorf("CA bundle: %w (apt-get install -y ca-certificates)", err)
	}
	es := []entry{
		{name: "usr/bin/kettle", mode: 0o755, body: b},
		{name: "etc/ssl/certs/ca-certificates.crt", mode: 0o644, body: ca},
		{name: "etc/passwd", mode: 0o644, body: []byte(fmt.Sprintf("root:x:0:0:root:/root:/sbin/nologin\nkettle:x:%d:%d:kettle:/data:/sbin/nologin\n", uid, uid))},
		{name: "etc/group", mode: 0o644, body: []byte(fmt.Sprintf("root:x:0:\nkettle:x:%d:\n", uid))},
		{name: "usr/share/doc/kettle/sbom.cdx.json", mode: 0o644, body: sbom},
		{name: "data", mode: 0o700, uid: uid, dir: true},
		{name: "tmp", mode: 0o1777, dir: true},
	}
	err = filepath.WalkDir(o.zoneinfo, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(o.zoneinfo, p)
		// right/ (leap seconds) doubles the size and nothing reads it.
		if d.IsDir() && (rel == "right" || rel == "posix") {
			return fs.SkipDir
		}
		if !d.Type().IsRegular() {
			return nil
		}
		body, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		es = append(es, entry{name: filepath.ToSlash(filepath.Join("usr/share/zoneinfo", rel)), mode: 0o644, body: body})
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("time zone database: %w (apt-get install -y tzdata)", err)
	}
	// Parent directories, then everything in name order.
	seen := map[string]bool{}
	for _, e := range es {
		if e.dir {
			seen[e.name] = true
		}
	}
	for _, e := range append([]entry(nil), es...) {
		for d := filepath.Dir(e.name); d != "."; d = filepath.Dir(d) {
			if !seen[d] {
				seen[d] = true
				es = append(es, entry{name: d, mode: 0o755, dir: true})
			}
		}
	}
	sort.Slice(es, func(i, j int) bool { return es[i].name < es[j].name })
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range es {
		h := &tar.Header{Name: e.name, Mode: e.mode, Uid: e.uid, Gid: e.uid, ModTime: o.epoch, Format: tar.FormatPAX}
		if e.dir {
			h.Typeflag, h.Name = tar.TypeDir, e.name+"/"
		} else {
			h.Typeflag, h.Size = tar.TypeReg, int64(len(e.body))
		}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if !e.dir {
			if _, err := tw.Write(e.body); err != nil {
				return nil, err
			}
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}

// sbomOf is a CycloneDX bill of materials of the Go modules compiled into
// bin, from its build information (what `go version -m` prints).
func sbomOf(bin string, o options) ([]byte, error) {
	bi, err := buildinfo.ReadFile(bin)
	if err != nil {
		return nil, fmt.Errorf("build information of %s: %w", bin, err)
	}
	comps := []cdx.Component{}
	for _, d := range bi.Deps {
		m := d
		if d.Replace != nil {
			m = d.Replace
		}
		c := cdx.Component{
			BOMRef:     "pkg:golang/" + m.Path + "@" + m.Version,
			Type:       cdx.ComponentTypeLibrary,
			Name:       m.Path,
			Version:    m.Version,
			PackageURL: "pkg:golang/" + m.Path + "@" + m.Version,
		}
		if m.Sum != "" {
			c.Properties = &[]cdx.Property{{Name: "go:module:sum", Value: m.Sum}}
		}
		comps = append(comps, c)
	}
	sort.Slice(comps, func(i, j int) bool { return comps[i].BOMRef < comps[j].BOMRef })
	main := cdx.Component{
		BOMRef: "pkg:golang/" + bi.Main.Path + "@" + o.version, Type: cdx.ComponentTypeApplication,
		Name: "kettle", Version: o.version, PackageURL: "pkg:golang/" + bi.Main.Path + "@" + o.version,
		Properties: &[]cdx.Property{{Name: "go:toolchain", Value: bi.GoVersion}, {Name: "vcs:revision", Value: o.revision}},
	}
	bom := cdx.NewBOM()
	// A serial number from the content, not a random one: reproducible.
	bom.SerialNumber = uuid.NewSHA1(uuid.NameSpaceURL, []byte(o.source+"@"+o.revision+"/"+o.version)).URN()
	bom.Metadata = &cdx.Metadata{Timestamp: o.epoch.Format(time.RFC3339), Component: &main}
	bom.Components = &comps
	var out bytes.Buffer
	enc := cdx.NewBOMEncoder(&out, cdx.BOMFileFormatJSON)
	enc.SetPretty(true)
	if err := enc.Encode(bom); err != nil {
		return nil, err
	}
	return []byte(strings.TrimSpace(out.String()) + "\n"), nil
}
