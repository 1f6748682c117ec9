package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// checkpointer copies the WAL into the database file from its own
// connection, so that a commit never pays for a checkpoint (the writer runs
// with wal_autocheckpoint=0). It runs every interval, or sooner once the
// writer reports kick pages written since the last run.
//
// A PASSIVE checkpoint takes no lock a writer needs, but under steady
// ingest it never catches up with the end of the WAL, and the WAL starts
// over only once a checkpoint has. So when the WAL is longer than kick
// frames, a RESTART checkpoint follows: it copies the little the PASSIVE
// one left, holding off the writer only for that (and one fsync), and makes
// the next commit write the WAL from its start, which keeps the WAL file
// short and its pages hot.
type checkpointer struct {
	db      *sql.DB
	every   time.Duration
	kick    int64
	pages   atomic.Int64 // WAL pages written (an estimate) since the last run
	wake    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	lastErr atomic.Pointer[error]
}

func startCheckpointer(ctx context.Context, dsn string, every time.Duration, kick int64) (*checkpointer, error) {
	db, err := sql.Open("sqlite3", dsn)
	if err != nil {
		return nil, err
	}
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, err
	}
	c := &checkpointer{
		db: db, every: every, kick: max(kick, 1),
		wake: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
	}
	go c.run()
	return c, nil
}

// wrote tells the checkpointer that a commit wrote about n pages to the WAL.
func (c *checkpointer) wrote(n int64) {
	if c.pages.Add(n) >= c.kick {
		select {
		case c.wake <- struct{}{}:
		default:
		}
	}
}

func (c *checkpointer) run() {
	defer close(c.done)
	t := time.NewTicker(c.every)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
		case <-c.wake:
		}
		c.pages.Store(0)
		if err := c.checkpoint(); err != nil {
			c.lastErr.Store(&err)
		}
	}
}

func (c *checkpointer) checkpoint() error {
	var busy, log, done int64
	if err := c.db.QueryRow("PRAGMA wal_checkpoint(PASSIVE)").Scan(&busy, &log, &done); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	if log > c.kick {
		if _, err := c.db.Exec("PRAGMA wal_checkpoint(RESTART)"); err != nil && !isBusy(err) {
			return fmt.Errorf("restart checkpoint: %w", err)
		}
	}
	return nil
}

// close stops the goroutine and closes the connection. A checkpoint that
// failed (the file is then only as big as it gets, no data is at risk) is
// reported here.
func (c *checkpointer) close() error {
	close(c.stop)
	<-c.done
	err := c.db.Close()
	if p := c.lastErr.Load(); p != nil && !isBusy(*p) {
		err = errors.Join(err, fmt.Errorf("background WAL %w", *p))
	}
	return err
}
