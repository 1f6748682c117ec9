// Package browsertest starts the real browser the UI tests drive: Debian's
// Chromium through chromedp, headless, with the flags this machine needs
// (no sandbox as root, no background networking the closed network refuses)
// and a throwaway profile.
package browsertest

import (
	"context"
	"os"
	"testing"

	"github.com/chromedp/chromedp"
)

// Path is where Debian's chromium package installs the browser.
const Path = "/usr/bin/chromium"

// New returns a chromedp context for a fresh headless Chromium with a window
// of width × height, stopped when parent ends or the test cleans up. A
// missing browser fails the test (CI installs it), never skips it.
func New(t testing.TB, parent context.Context, width, height int, extra ...chromedp.ExecAllocatorOption) context.Context {
	t.Helper()
	if _, err := os.Stat(Path); err != nil {
		t.Fatalf("Chromium not found at %s: apt-get install -y chromium (make deps does it)", Path)
	}
	opts := append([]chromedp.ExecAllocatorOption{
		chromedp.ExecPath(Path),
		chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU, chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.Flag("disable-dev-shm-usage", true),
		chromedp.Flag("disable-extensions", true),
		chromedp.UserDataDir(t.TempDir()),
		// Chromium's singleton socket directory goes to TMPDIR and
		// outlives a killed browser: keep it in the test's directory.
		chromedp.Env("TMPDIR=" + t.TempDir()),
		chromedp.WindowSize(width, height),
	}, extra...)
	actx, acancel := chromedp.NewExecAllocator(parent, opts...)
	bctx, bcancel := chromedp.NewContext(actx)
	t.Cleanup(func() { bcancel(); acancel() })
	return bctx
}
